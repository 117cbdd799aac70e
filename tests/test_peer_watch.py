"""supo_jax.utils.PeerWatch without processes: a key-value store of our own stands in for
jax.distributed's, and the exit is recorded instead of taken."""
import threading

from supo_jax.utils import PEER_LOST_EXIT, PeerWatch


class Store:
    """jax.distributed's client as PeerWatch uses it; a write of `gated` waits for `go`."""

    def __init__(self, gated: str = "\0"):
        self.kv, self.writes, self.gated = {}, [], gated
        self.blocked, self.go = threading.Event(), threading.Event()

    def key_value_set(self, key, value, allow_overwrite=False):
        if value.startswith(self.gated):
            self.blocked.set()
            assert self.go.wait(10)
        self.kv[key] = value
        self.writes.append((key, value))

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def _watch(store, monkeypatch):
    w = PeerWatch(store, me=1, n=2, timeout_s=10)
    exits = []
    w._exit = lambda code, silent=(): exits.append(code)
    monkeypatch.setattr(PeerWatch, "_active", w)
    return w, exits


def _mine(store):
    return [v for k, v in store.writes if k == PeerWatch.PREFIX + "1"]


def test_an_error_is_never_overwritten_by_the_watch_stopping(monkeypatch):
    """The watch has decided to stop (a peer is silent) and is writing its word when the main
    thread leaves with an error: one of the two words is this process's last, never the
    error followed by "stopped" (which the others read as a clean departure)."""
    store = Store(gated="stopped")
    w, exits = _watch(store, monkeypatch)
    watch = threading.Thread(target=w._fail, args=("process 0 has not been heard from",))
    watch.start()
    assert store.blocked.wait(10)               # the watch is between its check and its word
    main = threading.Thread(target=PeerWatch.leave, args=("error: boom",), kwargs={"code": 1})
    main.start()
    main.join(0.3)
    store.go.set()
    watch.join(10)
    main.join(10)
    said = _mine(store)
    assert said == ["stopped: process 0 has not been heard from"], said
    assert sorted(exits) == [1, PEER_LOST_EXIT]


def test_the_watch_says_nothing_after_the_main_thread_left(monkeypatch):
    store = Store()
    w, exits = _watch(store, monkeypatch)
    PeerWatch.leave("error: boom", code=1)
    w._fail("process 0 has not been heard from")
    assert _mine(store) == ["error: boom"] and exits == [1]
