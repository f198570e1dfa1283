"""Workers' tokens added to the job's auth Secret, many to one request.

Each worker's pod reads its own token from the job's Secret, so the token must be there before the pod is
created. One patch per worker would double the API requests of every start and every replacement: a
preemption storm of 300 workers would cost 600 requests, twice the time under the request budget.
:class:`SecretTokens` instead gathers the tokens that creator threads ask for while a patch is in flight and
adds them all with the next one (a group commit): a storm costs its pods' creations plus a few patches.

Contract of :meth:`SecretTokens.add`: it returns once a patch holding the token has succeeded (at once for a
token added before), and raises what that patch raised (an ``ApiException``, a connection error) or
:class:`TimeoutError` when ``deadline`` passes first; the caller retries as it retries a failed creation.
A token is never removed: the Secret goes with the job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: Sends one patch adding ``{identity: token}`` entries to the Secret, waiting for the request budget until
#: the deadline given (``JobApi.add_secret_data`` with the Secret's name and the data encoded).
Patch = Callable[[dict[str, str], float], None]


class SecretTokens:
    """The tokens of one job's Secret that this master added, and the ones on their way (see the module)."""

    def __init__(self, patch: Patch) -> None:
        self._patch = patch
        self._changed = threading.Condition()
        self._added: set[str] = set()  # identities whose token a patch succeeded with
        self._waiting: dict[str, str] = {}  # identity: token, for the next patch
        self._failed: dict[str, BaseException] = {}  # identity: what its patch raised, for its caller
        self._patching = False

    def add(self, identity: str, token: str, deadline: float) -> None:
        """Have ``token`` in the Secret under ``identity`` (see the module's contract)."""
        with self._changed:
            if identity in self._added:
                return
            self._failed.pop(identity, None)  # an earlier caller's failure, which that caller gave up on
            self._waiting[identity] = token
            while True:
                if identity in self._added:
                    return
                error = self._failed.pop(identity, None)
                if error is not None:
                    raise error
                if not self._patching:
                    self._send_waiting(deadline)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._waiting.pop(identity, None)
                    raise TimeoutError(f"no patch of the job's Secret added {identity}'s token in time")
                self._changed.wait(remaining)

    def _send_waiting(self, deadline: float) -> None:
        """Patch the Secret with every waiting token (the caller holds the lock; released meanwhile)."""
        batch, self._waiting = self._waiting, {}
        self._patching = True
        self._changed.release()
        error: BaseException | None = None
        try:
            self._patch(batch, deadline)
        except BaseException as failure:  # handed to every caller of the batch, which retries
            error = failure
        finally:
            self._changed.acquire()
            self._patching = False
            if error is None:
                self._added.update(batch)
            else:
                self._failed.update(dict.fromkeys(batch, error))
            self._changed.notify_all()
