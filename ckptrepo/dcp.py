"""``ckptrepo.dcp.Writer`` and ``ckptrepo.dcp.Reader``: torch.distributed.checkpoint storage over a repository."""
from ckptrepo.integrations.dcp import Reader, Writer

__all__ = ["Reader", "Writer"]
