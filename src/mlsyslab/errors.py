"""Errors that name the field, the value and what would be valid.

Every user-facing check raises one of these before any work starts; the CLI turns them into one
line on stderr and exit code 2, the server into an HTTP 4xx body.
"""


class MlsysError(ValueError):
    """Base class of mlsyslab's input errors."""


class InvalidValue(MlsysError):
    """A field holds a value outside what is valid: `field=value: reason (valid: ...)`."""

    def __init__(self, field: str, value, valid: str, reason: str = ""):
        self.field, self.value, self.valid, self.reason = field, value, valid, reason
        detail = f": {reason}" if reason else ""
        super().__init__(f"{field}={value!r} is invalid{detail} (valid: {valid})")

    def __reduce__(self):  # pickled by its fields (the engine process sends admission errors to the server)
        return type(self), (self.field, self.value, self.valid, self.reason)


class QueueFull(MlsysError):
    """A serving engine's waiting queue is at its bound (`serve.scheduler`; HTTP 503): not the input's fault, retry."""


class InvalidValues(InvalidValue):
    """Several rules broken at once, all named in one refusal (`a=1 is invalid (...); b=2 is invalid (...)`) so a
    layout is fixed in one go; `field` and the rest are the first one's."""

    def __init__(self, errors: list[InvalidValue]):
        first = errors[0]
        super().__init__(first.field, first.value, first.valid, first.reason)
        self.errors = errors
        self.args = ("; ".join(str(error) for error in errors),)

    def __reduce__(self):
        return type(self), (self.errors,)


def raise_all(errors: list[InvalidValue]) -> None:
    """Raise nothing, the one error, or all of them as InvalidValues — a field's first error only (a value that
    breaks two rules is named once, by the first)."""
    first: dict = {}
    for error in errors:
        first.setdefault(error.field, error)
    errors = list(first.values())
    if len(errors) > 1:
        raise InvalidValues(errors)
    if errors:
        raise errors[0]


class UnknownName(MlsysError):
    """A catalog lookup found nothing; the message lists close matches."""

    def __init__(self, kind: str, name: str, known: list[str], listing: str | None = None):
        """`listing`: the command that lists them (default `mlsys zoo KIND`)."""
        import difflib

        close = difflib.get_close_matches(name.lower(), known, n=5, cutoff=0.5)
        hint = f"closest: {', '.join(close)}" if close else f"known: {', '.join(sorted(known)[:12])}, ..."
        self.kind, self.name = kind, name
        super().__init__(f"{kind}={name!r} is not in the catalog ({hint}; list them with "
                         f"`{listing or f'mlsys zoo {kind}'}`)")


class UnsupportedDtype(MlsysError):
    """The accelerator has no peak rate for the dtype: we never fall back silently."""

    def __init__(self, accelerator: str, dtype: str, supported: list[str]):
        super().__init__(
            f"dtype={dtype!r} is not supported by {accelerator} (valid: {', '.join(supported)})"
        )
