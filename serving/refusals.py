"""The messages of the refusals both fronts make themselves, as ``str.format`` templates: the Python request
path (``batcher.py``, ``inference.py``) formats them, and the C++ front (``cpp_loader/tools/front/``) gets them
from ``serving/front.py`` (``front_tables()``) when it starts and fills the same fields, so that a client hears
the same words whichever front refused it (tests/cpp_loader/test_front_shared.py).
"""

CANCELLED = "cancelled by the client"  # the client gave up while its request waited (ErrorKind.CANCELLED)
DEADLINE_QUEUED = "deadline passed while queued"  # (ErrorKind.DEADLINE)
QUEUE_FULL = "queue full ({max_queue} requests waiting)"  # the model's queue holds max_queue (ErrorKind.OVERLOADED)
OVERLOADED = (  # total request bytes would be in flight, over limit (--max-inflight-mb; ErrorKind.OVERLOADED)
    "{total} bytes of requests would be in flight, over the limit of {limit} (--max-inflight-mb); retry later"
)
INTERNAL = "{type}: {error}"  # anything else: the exception's type and message (ErrorKind.INTERNAL)
