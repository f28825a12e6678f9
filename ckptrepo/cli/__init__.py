"""The ckptrepo command line: a thin click front end over the ckptrepo library."""

__all__: list[str] = []   # the command line is ckptrepo.cli.main.main, run as `ckptrepo` or `python -m ckptrepo.cli`
