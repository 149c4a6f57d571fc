"""One exception type for user mistakes: stage CLIs print its message as one line and exit 2."""
import contextlib


class QerlError(Exception):
    """A user-facing error (bad config, bad file, bad tensor). The message names the culprit."""


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA (or other accelerator) allocation failure from torch: torch.OutOfMemoryError, without importing torch."""
    return any(t.__name__ == "OutOfMemoryError" and t.__module__.startswith("torch") for t in type(exc).__mro__)


def out_of_memory(exc: BaseException, what: str, knobs: str = "") -> QerlError:
    """One line for an out-of-memory error in `what`: torch's first three sentences (out of memory, what it tried
    to allocate, what was free) and the config knobs that lower the need."""
    sentences = " ".join(str(exc).split()).split(". ")
    said = ". ".join(sentences[:3]).rstrip(".")[:300]  # "CUDA out of memory. Tried to allocate X. GPU 0 has ..."
    return QerlError(f"{what} ran out of GPU memory ({said})" + (f"; {knobs}" if knobs else ""))


@contextlib.contextmanager
def out_of_memory_names(what: str, knobs: str = ""):
    """An out-of-memory error inside becomes one QerlError naming `what` and the knobs (torch's error its cause)."""
    try:
        yield
    except Exception as exc:
        if is_out_of_memory(exc):
            raise out_of_memory(exc, what, knobs) from exc
        raise
