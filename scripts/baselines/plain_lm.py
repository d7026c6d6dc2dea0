"""The LM example (examples/char_lm) as a plain single-process torch loop: the same model,
data, batch, optimizer and clipping, no orchestrator, no Ray. Prints JSON with the steady
rate (sequences per second from the end of the first step to the end of the last one).

    python scripts/baselines/plain_lm.py --steps 300 --threads 2 --out plain.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "char_lm"))
from charlm.data import SourceBytes  # noqa: E402
from charlm.model import TinyGPT  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = SourceBytes("train", seq_len=64)
    model = TinyGPT(dim=128, heads=4, layers=2, seq_len=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003, weight_decay=0.01)
    batches = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True,
                                          drop_last=True,
                                          generator=torch.Generator().manual_seed(args.seed))
    model.train()
    step, first_step_at = 0, None
    while step < args.steps:
        for x, y in batches:
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if first_step_at is None:
                loss.item()
                first_step_at = time.time()
            if step == args.steps:
                break
    loss.item()
    last_step_at = time.time()
    rate = (args.steps - 1) * args.batch_size / (last_step_at - first_step_at)
    result = {"steps": args.steps, "batch_size": args.batch_size, "threads": args.threads,
              "steady_samples_per_s": round(rate, 2), "tokens_per_sample": 64,
              "steady_tokens_per_s": round(rate * 64, 1), "final_loss": loss.item(),
              "first_step_at": first_step_at, "last_step_at": last_step_at}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
