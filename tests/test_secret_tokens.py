"""Workers' tokens added to the job's Secret many to a patch (``edl_argo.pods.secret_tokens``)."""

from __future__ import annotations

import threading
import time

import pytest

from edl_argo.pods.secret_tokens import SecretTokens

pytestmark = pytest.mark.timeout(60)


class SlowSecret:
    """A Secret whose patches take ``seconds`` each and fail while ``failures`` remain."""

    def __init__(self, seconds: float = 0.05, failures: int = 0) -> None:
        self.seconds, self.failures = seconds, failures
        self.data: dict[str, str] = {}
        self.patches: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def patch(self, tokens: dict[str, str], deadline: float) -> None:
        assert deadline > time.monotonic()
        time.sleep(self.seconds)
        with self._lock:
            self.patches.append(dict(tokens))
            if self.failures:
                self.failures -= 1
                raise ConnectionError("the API server is restarting")
            self.data.update(tokens)


def add_all(tokens: SecretTokens, identities: list[str], seconds: float = 10.0) -> dict[str, BaseException]:
    """``tokens.add`` from one thread per identity, all at once; what each raised, by identity."""
    errors: dict[str, BaseException] = {}
    start = threading.Barrier(len(identities))

    def add(identity: str) -> None:
        start.wait()
        try:
            tokens.add(identity, f"token-of-{identity}", time.monotonic() + seconds)
        except BaseException as error:
            errors[identity] = error

    threads = [threading.Thread(target=add, args=(identity,)) for identity in identities]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return errors


def test_tokens_asked_for_together_share_a_few_patches_and_each_is_in_the_secret() -> None:
    secret = SlowSecret()
    tokens = SecretTokens(secret.patch)
    identities = [f"worker-{i}" for i in range(40)]
    assert add_all(tokens, identities) == {}
    assert secret.data == {identity: f"token-of-{identity}" for identity in identities}
    assert 1 <= len(secret.patches) <= 4, [len(patch) for patch in secret.patches]  # one per worker before
    assert sum(len(patch) for patch in secret.patches) == len(identities)  # none sent twice
    tokens.add("worker-3", "token-of-worker-3", time.monotonic() + 1)  # a token added before: no request
    assert len(secret.patches) <= 4


def test_a_failed_patch_fails_every_caller_it_carried_and_their_retries_succeed() -> None:
    secret = SlowSecret(failures=1)
    tokens = SecretTokens(secret.patch)
    identities = [f"worker-{i}" for i in range(10)]
    errors = add_all(tokens, identities)
    carried = set(secret.patches[0])
    assert set(errors) == carried and carried  # the first patch's callers, and only they, saw its failure
    assert all(isinstance(error, ConnectionError) for error in errors.values())
    assert not carried & set(secret.data)
    assert add_all(tokens, sorted(carried)) == {}  # as a pod's creator retries
    assert secret.data == {identity: f"token-of-{identity}" for identity in identities}


def test_a_caller_waiting_for_a_patch_past_its_deadline_gets_a_timeout_and_its_token_comes_later() -> None:
    secret = SlowSecret(seconds=1.0)
    tokens = SecretTokens(secret.patch)
    first = threading.Thread(target=tokens.add, args=("worker-0", "t0", time.monotonic() + 10))
    first.start()
    time.sleep(0.2)  # the first patch is on its way: the next token waits for the one after
    with pytest.raises(TimeoutError, match="worker-1"):
        tokens.add("worker-1", "t1", time.monotonic() + 0.3)
    first.join(10)
    tokens.add("worker-1", "t1", time.monotonic() + 10)
    assert secret.data == {"worker-0": "t0", "worker-1": "t1"}
