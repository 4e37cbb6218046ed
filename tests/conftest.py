import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402  (after the path set-up above)
import torch  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():  # type: ignore[no-untyped-def]
    """Torch on one thread for a module: the tests' subprocesses and a second pool would only
    compete for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def close_leftover_checkpointers():  # type: ignore[no-untyped-def]
    """A failed test must not leave hooks, writer threads or locks behind for the next."""
    from ldformat.capture.hooks import open_at_exit

    yield
    for ck in list(open_at_exit):
        try:
            ck.close()
        except Exception:
            pass
