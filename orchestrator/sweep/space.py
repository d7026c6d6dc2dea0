"""From Hydra's sweep syntax to the trials: a search space for Ray Tune, and back to overrides.

Discrete sweeps (`a,b,c`, `choice(a,b)`, `range(1,5)`) keep their values as override strings,
so a trial's override is exactly what the user wrote. `interval(a,b)` is a continuous range:
`tag(log, interval(...))` samples it log-uniformly, `tag(int, interval(...))` as integers.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override
from hydra.errors import OverrideParseException

from orchestrator.errors import ConfigError, one_line


@dataclass(frozen=True)
class Dimension:
    key: str
    values: tuple[str, ...] = ()  # discrete: the override strings
    low: float | None = None  # continuous: interval(low, high)
    high: float | None = None
    log: bool = False
    integer: bool = False

    @property
    def discrete(self) -> bool:
        return self.low is None

    def override(self, value) -> str:
        if self.discrete:
            return f"{self.key}={value}"
        return f"{self.key}={int(value) if self.integer else repr(float(value))}"


@dataclass(frozen=True)
class SweepSpace:
    fixed: tuple[str, ...]  # overrides shared by every trial
    dimensions: tuple[Dimension, ...]

    @property
    def grid_size(self) -> int:
        size = 1
        for dim in self.dimensions:
            size *= len(dim.values) if dim.discrete else 0
        return size

    def overrides(self, sample: dict) -> list[str]:
        """One trial's overrides from the values Tune chose (keyed by the dimension's key)."""
        return [*self.fixed, *(d.override(sample[d.key]) for d in self.dimensions)]


def parse(line: str) -> Override:
    try:
        return OverridesParser.create().parse_overrides([line])[0]
    except OverrideParseException as exc:
        raise ConfigError(unparsable(line, exc)) from exc


def unparsable(line: str, exc: Exception) -> str:
    """One line for an override Hydra's grammar refuses, with the fix when it is the usual
    one: a value holding brackets (a glob's data/part[01].parquet), a comma or a space."""
    key, _, value = line.partition("=")
    hint = ""
    if value and not value.startswith(("'", '"')) and any(c in value for c in "[]{}(), "):
        hint = f"; a value with brackets, commas or spaces goes in quotes: '{key}=\"{value}\"'"
    return f"cannot parse {line!r}: {one_line(exc)}{hint}"


def dimension(ov: Override) -> Dimension:
    key = ov.get_key_element()
    if ov.is_discrete_sweep():
        return Dimension(key, tuple(ov.sweep_string_iterator()))
    sweep = ov.value()
    assert isinstance(sweep, IntervalSweep)
    low, high = float(sweep.start), float(sweep.end)
    if not low < high:
        raise ConfigError(f"{key}=interval({low}, {high}) is not allowed: the low end must be "
                          "below the high end")
    if "log" in sweep.tags and low <= 0:
        raise ConfigError(f"{key}=tag(log, interval({low}, {high})) is not allowed: log scale "
                          "needs a low end > 0")
    return Dimension(key, low=low, high=high, log="log" in sweep.tags,
                     integer="int" in sweep.tags)


def build_space(arguments: list[str], params: dict[str, str]) -> SweepSpace:
    """The command line's overrides (sweeps among them) over the search's `params`; a key on
    the command line wins over the same key in params."""
    fixed: list[str] = []
    dims: dict[str, Dimension] = {}
    for key, text in params.items():
        ov = parse(f"{key}={text}")
        if ov.is_sweep_override():
            dims[ov.get_key_element()] = dimension(ov)
        else:
            fixed.append(f"{key}={text}")
    for line in arguments:
        ov = parse(line)
        key = ov.get_key_element()
        fixed = [f for f in fixed if parse(f).get_key_element() != key]
        dims.pop(key, None)
        if ov.is_sweep_override():
            dims[key] = dimension(ov)
        else:
            fixed.append(line)
    return SweepSpace(tuple(fixed), tuple(dims.values()))


def check_search(space: SweepSpace, search: str) -> None:
    if search == "grid":
        for dim in space.dimensions:
            if not dim.discrete:
                raise ConfigError(
                    f"{dim.key}=interval(...) is not allowed with hydra.sweeper.search=grid: "
                    "give a list of values, or search=random or search=optuna")


def tune_space(space: SweepSpace, search: str) -> dict:
    """Ray Tune's param_space: grid_search for a grid, distributions for a search."""
    from ray import tune

    out = {}
    for dim in space.dimensions:
        if dim.discrete:
            out[dim.key] = (tune.grid_search(list(dim.values)) if search == "grid"
                            else tune.choice(list(dim.values)))
        elif dim.integer:
            low, high = int(dim.low), int(dim.high) + 1  # interval ends are inclusive
            out[dim.key] = tune.lograndint(low, high) if dim.log else tune.randint(low, high)
        else:
            out[dim.key] = (tune.loguniform(dim.low, dim.high) if dim.log
                            else tune.uniform(dim.low, dim.high))
    return out


def check_values(space: SweepSpace, limit: int = 512) -> list[list[str]]:
    """Override lists that, composed, check every value a trial may get: each discrete value
    and both ends of each interval. Every combination while there are at most `limit` (cross-
    field checks such as min_workers <= workers need them); past that, one dimension at a time."""
    choices = [dim.values if dim.discrete else (dim.low, dim.high) for dim in space.dimensions]
    count = 1
    for values in choices:
        count *= len(values)
    if count <= limit:
        combos: list[list[str]] = [list(space.fixed)]
        for dim, values in zip(space.dimensions, choices, strict=True):
            combos = [[*c, dim.override(v)] for c in combos for v in values]
        return combos
    checks = [list(space.fixed)]
    for dim, values in zip(space.dimensions, choices, strict=True):
        checks += [[*space.fixed, dim.override(v)] for v in values]
    return checks
