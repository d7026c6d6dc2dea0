"""Secrets never reach the files a run or a sweep writes: hidden by key name and by value (a
URL's credentials, a secret-named override or query parameter, the environment's secrets), in
run.json, Hydra's .hydra files and the sweep's report. Pure: no Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from orchestrator.cli import CONF_DIR
from orchestrator.driver.record import RunRecord
from orchestrator.redaction import REDACTED, env_secrets, is_secret_name, redact, redact_text
from orchestrator.sweep.report import write_report

ROOT = Path(__file__).resolve().parent.parent
ENV_SECRET = "envsecret-Value-0123456789"


@pytest.mark.parametrize("name", [
    "secret_key", "api_key", "apiKey", "auth", "password", "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID", "hf_token", "X-Amz-Signature", "credentials", "session_token",
    "storage.secret_key", "Authorization", "client_secret"])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "tokenizer", "max_tokens", "author", "name", "endpoint", "keep", "PWD", "storage.uri",
    "key", "X-Amz-Date",
    # a model's settings, and a path to a secret (not the secret): pad_token_id was hidden in
    # run.json and .hydra, and the dashboard's sign-in hint lost RAY_AUTH_TOKEN_PATH's file
    "pad_token_id", "eos_token_id", "token_dropout", "signature_dim", "RAY_AUTH_TOKEN_PATH",
    # a setting: Ray's "Set RAY_AUTH_MODE=disabled to opt out" read RAY_AUTH_MODE=***
    "RAY_AUTH_MODE", "auth_method"])
def test_names_that_are_not_secrets(name):
    assert not is_secret_name(name)


@pytest.mark.parametrize("text, hidden, kept", [
    ("http://user:pa55@host:9000/x", "pa55", "http://***@host:9000/x"),
    ("s3://AKIAX:se@cr@t@bucket/prefix", "se@cr", "s3://***@bucket/prefix"),
    ("https://ghp_0123456789@github.com/o/r", "ghp_0123456789", "https://***@github.com/o/r"),
    ("storage.secret_key=abc123 seed=1", "abc123", "storage.secret_key=*** seed=1"),
    ("+trainer.api_key='a b c'", "a b c", "+trainer.api_key=***"),
    ("https://b.s3/k?X-Amz-Signature=deadbeef&X-Amz-Date=20260101",
     "deadbeef", "X-Amz-Date=20260101"),
    ("Authorization: Bearer abcdefgh12345", "abcdefgh12345", "Bearer ***"),
    ("storage.secret_key=abc,seed=1", "abc,", "seed=1"),  # Hydra's override_dirname
    # about half of AWS secret keys hold a '/': the userinfo ends at the host's '@'
    ("storage.uri='s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG/bPxRfiCYKEY@bucket/p' is",
     "K7MDENG", "s3://***@bucket/p' is"),
])
def test_secrets_inside_strings_are_hidden(text, hidden, kept):
    shown = redact_text(text, secrets=[])
    assert hidden not in shown and kept in shown, shown


@pytest.mark.parametrize("text", [
    "s3://bucket/prefix/step_000000010", "mail me at a@b.example", "trainer.lr=0.1",
    "http://127.0.0.1:8265", "tokens=128", "s3://bucket/users/jane@corp.com/run",
    "git+https://github.com/o/r.git@v1",
    "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out."])
def test_plain_strings_are_kept(text):
    assert redact_text(text, secrets=[]) == text


def test_the_environments_secrets_are_hidden_wherever_they_appear(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-token-abcdef")
    monkeypatch.setenv("MY_SERVICE_PASSWORD", "pw-from-env-1")
    monkeypatch.setenv("SHORT_TOKEN", "ab")  # too short to search for
    secrets = env_secrets()
    assert {ENV_SECRET, "ray-token-abcdef", "pw-from-env-1"} <= set(secrets)
    assert "ab" not in secrets and os.environ["PWD"] not in secrets
    config = {"storage": {"endpoint": f"http://k:{ENV_SECRET}@h", "region": "us-east-1"},
              "data": {"path": f"s3://b/{ENV_SECRET}/train.parquet", "rows": 10},
              "resume": "ray-token-abcdef", "note": ["pw-from-env-1", 3, None],
              "trainer": {"auth": {"user": "me"}, "api_key": None, "lr": 0.1}}
    shown = redact(config)
    text = json.dumps(shown)
    for secret in (ENV_SECRET, "ray-token-abcdef", "pw-from-env-1"):
        assert secret not in text
    assert shown["trainer"] == {"auth": REDACTED, "api_key": None, "lr": 0.1}
    assert shown["data"] == {"path": "s3://b/***/train.parquet", "rows": 10}
    assert shown["storage"]["region"] == "us-east-1"


def test_run_json_hides_secrets_in_errors_and_warnings(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    rec = RunRecord("r", "ddp", redact({"storage": {"secret_key": "S3CR3T-KEY"}}), "/ck")
    rec.warning("checkpoint http://admin:hunter22@minio:9000/b/step_1 is unreadable")
    rec.finish("failed", f"S3 said: InvalidAccessKey for {ENV_SECRET}", 0.0)
    rec.write(str(tmp_path / "run.json"))
    text = (tmp_path / "run.json").read_text()
    for secret in ("S3CR3T-KEY", "hunter22", ENV_SECRET):
        assert secret not in text
    assert "http://***@minio:9000/b/step_1" in text


def test_the_sweep_report_hides_secrets_in_overrides_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    rows = [{"trial": "t1", "overrides": ["storage.endpoint=http://u:pw-in-url@h:9000",
                                          "cluster.workers=1"],
             "status": "failed", "workers": 1, "samples_per_s": None, "metric": None,
             "metrics": {}, "error": f"denied for {ENV_SECRET}"}]
    summary = {"name": "s", "dir": str(tmp_path), "search": "grid", "metric": "test_accuracy",
               "mode": "max", "fixed_overrides": ["storage.secret_key=fixed-secret-9"],
               "max_concurrent": 1, "cpu_budget": 1.0, "wall_s": 1.0, "best": None,
               "trials": rows}
    paths = write_report(summary, tmp_path)
    for path in (paths["json"], paths["markdown"]):
        text = path.read_text()
        for secret in ("pw-in-url", ENV_SECRET, "fixed-secret-9"):
            assert secret not in text, path.name
    assert "storage.endpoint=http://***@h:9000" in paths["markdown"].read_text()


def test_the_orchestrators_config_registers_the_hydra_callback():
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", return_hydra_config=True)
    assert cfg.hydra.callbacks.redact_outputs._target_ == \
        "orchestrator.hydra_redaction.RedactHydraFiles"


def test_hydras_own_files_keep_no_secret(tmp_path):
    """A real Hydra job (no Ray) with secrets on its command line and in its environment:
    nothing Hydra leaves in the output folder holds them."""
    app = tmp_path / "app.py"
    app.write_text("import hydra\n\n\n@hydra.main(version_base='1.3', config_path=None, "
                   "config_name=None)\ndef main(cfg):\n    print('ran')\n\n\nmain()\n")
    run_dir = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_SECRET_ACCESS_KEY": ENV_SECRET}
    result = subprocess.run(
        [sys.executable, str(app), f"hydra.run.dir={run_dir}",
         "+hydra.callbacks.redact._target_=orchestrator.hydra_redaction.RedactHydraFiles",
         "+storage.endpoint=http://user:pa55word-in-url@host:9000",
         "+storage.secret_key=plain-secret-1", f"+note={ENV_SECRET}",
         "+data.path=${oc.env:AWS_SECRET_ACCESS_KEY}", "+trainer.lr=0.1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ran" in result.stdout, result.stderr
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"config.yaml", "hydra.yaml", "overrides.yaml"}
    for path in files:
        text = path.read_text()
        for secret in ("pa55word-in-url", "plain-secret-1", ENV_SECRET):
            assert secret not in text, f"{path.name}: {text}"
    config = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "lr: 0.1" in config and "http://***@host:9000" in config
    assert "${oc.env:AWS_SECRET_ACCESS_KEY}" in config  # a reference, not the secret


def test_log_lines_and_error_lines_hide_secrets(monkeypatch, capsys):
    """Every log record (whatever its logger, its traceback too) and every `error:` line."""
    import io
    import logging

    from orchestrator.errors import print_error
    from orchestrator.redaction import hide_secrets_in_logs

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    factory = logging.getLogRecordFactory()
    hide_secrets_in_logs()
    # A logger of no library's: another test may have set a library's level (Ray's logger
    # dropped the warning below when the whole suite ran).
    logger, stream = logging.getLogger("some.users.library"), io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.warning("endpoint %s, key %s", "http://user:pa55word-in-url@host:9000", ENV_SECRET)
        try:
            raise RuntimeError(f"cannot sign with {ENV_SECRET}")
        except RuntimeError:
            logger.exception("upload failed")
    finally:
        logger.removeHandler(handler)
        logging.setLogRecordFactory(factory)
    print_error(f"data.path='/data/{ENV_SECRET}': no parquet data there")
    out = stream.getvalue() + capsys.readouterr().err
    assert "pa55word-in-url" not in out and ENV_SECRET not in out, out
    assert "http://***@host:9000" in out and "cannot sign with ***" in out
    assert "error: data.path='/data/***': no parquet data there" in out


def test_a_refused_command_prints_no_secret_of_its_environment(tmp_path):
    """The real command: an `${oc.env:...}` value quoted back by the refusal is hidden."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_SECRET_ACCESS_KEY": ENV_SECRET}
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", f"hydra.run.dir={tmp_path / 'run'}", "data=parquet",
         "data.path=${oc.env:AWS_SECRET_ACCESS_KEY}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert ENV_SECRET not in result.stdout + result.stderr
    assert result.stderr.startswith("error: data.path=") and "***" in result.stderr
