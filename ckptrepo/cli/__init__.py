"""The ckptrepo command line: a thin click front end over the ckptrepo library."""
