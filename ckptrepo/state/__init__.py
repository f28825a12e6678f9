"""Training states as data: flattening a state into a skeleton plus tensor records, and reading skeletons.
"""

from typing import TYPE_CHECKING

from ckptrepo._lazy import lazy_exports

# Facade: the names other layers import from this package, read from their modules when asked for (PEP 562)
# so that importing the package stays cheap. Its TYPE_CHECKING imports and _LAZY name the same (test_facades.py).
if TYPE_CHECKING:
    from ckptrepo.state._providers import (
        DICT,
        DTYPE_NAMES,
        LIST,
        NDARRAY,
        NPGEN,
        ODICT,
        SCALAR,
        STATEFUL,
        TENSOR,
        TORCH_DTYPES,
        TUPLE,
        TensorRecord,
        flatten,
        is_dtensor,
        is_stateful,
        key_str,
        malformed_skeleton,
        overlap_error,
        overlapping_elements,
        own_containers,
        path_str,
        torch_viewable,
        unflatten,
    )
    from ckptrepo.state._skeleton import BIGINT, NPSCALAR, holds_tensors, key_value, numel, plain_values
    from ckptrepo.state._wordsum import GROUP_BYTES, wordsum_digests

_LAZY = {
    "ckptrepo.state._providers": ("DICT", "DTYPE_NAMES", "LIST", "NDARRAY", "NPGEN", "ODICT", "SCALAR", "STATEFUL",
                                  "TENSOR", "TORCH_DTYPES", "TUPLE", "TensorRecord", "flatten", "is_dtensor",
                                  "is_stateful", "key_str", "malformed_skeleton", "overlap_error",
                                  "overlapping_elements", "own_containers", "path_str", "torch_viewable", "unflatten"),
    "ckptrepo.state._skeleton": ("BIGINT", "NPSCALAR", "holds_tensors", "key_value", "numel", "plain_values"),
    "ckptrepo.state._wordsum": ("GROUP_BYTES", "wordsum_digests"),
}
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["BIGINT", "DICT", "DTYPE_NAMES", "GROUP_BYTES", "LIST", "NDARRAY", "NPGEN", "NPSCALAR", "ODICT", "SCALAR",
           "STATEFUL", "TENSOR", "TORCH_DTYPES", "TUPLE", "TensorRecord", "flatten", "holds_tensors", "is_dtensor",
           "is_stateful", "key_str", "key_value", "malformed_skeleton", "numel", "overlap_error",
           "overlapping_elements", "own_containers", "path_str", "plain_values", "torch_viewable", "unflatten",
           "wordsum_digests"]
# End of facade.
