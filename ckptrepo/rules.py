"""Sharding rules (public): how each parameter of a model is split over tensor and pipeline ranks.

The rules live in :mod:`ckptrepo.parallel.rules`; this module keeps ``ckptrepo.rules`` the place users name.
"""
from ckptrepo.parallel.rules import (
                                     Fused,
                                     LocalParam,
                                     ParamShapes,
                                     Region,
                                     Replicated,
                                     Rules,
                                     Spec,
                                     Split,
                                     VocabSplit,
                                     global_shape,
                                     local_shape,
                                     megatron_gpt,
                                     regions,
)

__all__ = ["Fused", "LocalParam", "ParamShapes", "Region", "Replicated", "Rules", "Spec", "Split", "VocabSplit",
           "global_shape", "local_shape", "megatron_gpt", "regions"]
