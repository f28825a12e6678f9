"""What the tests share and are not tests themselves: assertion and CLI helpers (``helpers``), the S3 proxy
(``s3proxy``), the reference Megatron GPT (``megatron_ref``), the bodies of the processes that multi-process
tests start (``*_workers``, pickled to forkserver children by module name) and the scripts they launch by path
(``*_run``). Importable as ``support.*``: tests/ is on ``sys.path`` (tests/conftest.py's folder)."""
