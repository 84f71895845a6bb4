"""The grammars of the flags: ``parse_value`` reads any Config field's text by its type, and
the flags whose text is more than one int, float or word have a parser of their own here, which
takes the flag's (or its MPITRAIN_* variable's) text and returns the field's value, or raises a
UsageError saying what was expected (parse_value adds the flag's name and the text).
"""
from mpitrain.data import AUGMENTATIONS
from mpitrain.runtime.errors import UsageError


def parse_hidden(text):
    """'256,128' -> (256, 128): hidden layer widths of the MLP."""
    try:
        sizes = tuple(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise UsageError("expected comma-separated positive integers like 256,128")
    return sizes


def parse_milestones(text):
    """'30,60' -> (30, 60): epochs after which --lr-schedule step multiplies the lr by gamma."""
    try:
        epochs = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise UsageError("expected comma-separated epochs like 30,60") from None
    for m in epochs:
        if m < 1:
            raise UsageError(f"milestone {m}: epochs must be >= 1")
    for a, b in zip(epochs, epochs[1:]):
        if b <= a:
            raise UsageError(f"milestones must be strictly increasing ({b} after {a})")
    return epochs


def parse_augment(text):
    """'crop,flip' (any subset, any order) or 'none' -> the canonical 'crop,flip' / 'none'."""
    parts = [part.strip() for part in str(text).split(",")]
    if parts == ["none"]:
        return "none"
    unknown = [p for p in parts if p not in AUGMENTATIONS]
    if unknown:
        raise UsageError(f"unknown augmentation {unknown[0]!r}; expected 'none' or a "
                         f"comma-separated subset of {', '.join(AUGMENTATIONS)}")
    if len(set(parts)) != len(parts):
        raise UsageError("an augmentation is named twice")
    return ",".join(a for a in AUGMENTATIONS if a in parts)


def parse_betas(text):
    """'0.9,0.99' -> (0.9, 0.99): Adam's decay rates of the two moment averages."""
    try:
        betas = tuple(float(part) for part in str(text).split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise UsageError("expected two numbers in [0, 1) like 0.9,0.99")
    return betas


STOP_SIGNALS = ("TERM", "USR1", "USR2", "INT", "HUP")


def parse_signals(text):
    """'TERM,USR1' / 'sigterm' (any subset of STOP_SIGNALS, any case) or 'none' -> the
    canonical 'TERM,USR1' / 'none'."""
    parts = [p.strip().upper().removeprefix("SIG") for p in str(text).split(",")]
    if parts == ["NONE"]:
        return "none"
    unknown = [p for p in parts if p not in STOP_SIGNALS]
    if unknown or not parts:
        raise UsageError(f"unknown signal {unknown[0] if unknown else text!r}; expected 'none' or "
                         f"a comma-separated subset of {', '.join(STOP_SIGNALS)}")
    return ",".join(s for s in STOP_SIGNALS if s in parts)


def field_type(f):
    """The Python type a field's text is parsed into (Optional[int] -> int)."""
    if f.metadata.get("type"):
        return f.metadata["type"]
    hint = str(f.type)  # "<class 'int'>", "typing.Optional[int]", or a string annotation
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if name in hint:
            return kind
    return str


def parse_value(f, text, source):
    """Parse one flag's text for field ``f``; ``source`` names the flag (for the error)."""
    kind = field_type(f)
    try:
        return kind(text)
    except UsageError as exc:
        raise UsageError(f"{source}={text!r}: {exc}")
    except ValueError:
        raise UsageError(f"{source}={text!r}: expected {kind.__name__}")
