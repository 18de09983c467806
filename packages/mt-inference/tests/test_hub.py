"""mt_inference.hub: the hub's reachability, asked with real sockets (a name that cannot
resolve, a port nobody listens on, a port that answers)."""

from __future__ import annotations

import socket

from mt_inference.hub import OFFLINE_VARIABLES, offline_unless_reachable

UNRESOLVABLE = "https://hub.invalid"  # .invalid never resolves (RFC 2606)


def test_a_hub_out_of_reach_turns_the_offline_settings_on() -> None:
    environ = {"HF_ENDPOINT": UNRESOLVABLE}
    why = offline_unless_reachable(environ)
    assert why is not None and why.startswith("hub.invalid does not resolve"), why
    assert all(environ[name] == "1" for name in OFFLINE_VARIABLES)
    with socket.socket() as free:  # a port no one listens on: refused at once
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    environ = {"HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    why = offline_unless_reachable(environ, timeout=2)
    assert why is not None and why.startswith(f"127.0.0.1:{port} does not answer"), why
    assert all(environ[name] == "1" for name in OFFLINE_VARIABLES)


def test_a_hub_that_answers_or_settings_given_change_nothing() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        environ = {"HF_ENDPOINT": endpoint}
        assert offline_unless_reachable(environ) is None
        assert environ == {"HF_ENDPOINT": endpoint}
    for given in ({"HF_HUB_OFFLINE": "0"}, {"HF_DATASETS_OFFLINE": "1"},
                  {"TRANSFORMERS_OFFLINE": "1"}, {"HTTPS_PROXY": "http://proxy:3128"}):
        environ = {"HF_ENDPOINT": UNRESOLVABLE, **given}  # the user's say, or a proxy
        assert offline_unless_reachable(environ) is None
        assert environ == {"HF_ENDPOINT": UNRESOLVABLE, **given}
