"""The errors the scratch engine raises. They derive from RuntimeError, as torch's do, so code
that catches torch's autograd errors catches these."""


class SavedTensorModifiedError(RuntimeError):
    """A tensor the graph saved for backward was changed in place after it was saved."""


class GraphFreedError(RuntimeError):
    """backward() reached a node whose saved tensors an earlier backward() freed."""


class InPlaceOnGraphError(RuntimeError):
    """An in-place operation on a tensor that requires grad while grad mode is on."""
