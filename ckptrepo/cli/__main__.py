"""``python -m ckptrepo.cli``: the command line, as the ``ckptrepo`` script runs it."""
from ckptrepo.cli.main import main

main()
