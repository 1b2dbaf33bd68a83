"""The error an instruction or view raises when a kernel breaks a hardware rule."""


class NkiValidationError(AssertionError):
    """Raised when hardware constraints are violated (nki.isa.NkiValidationError).

    An AssertionError too, as the NKI simulator raises its checks ("tensor_tensor data1
    partition dimension 256 exceeds maximum 128"), so tests written for it catch ours."""
