"""The pool's Secret rotates under running pods (kvfleet.serving.credentials): the previous values stay
valid for a grace period, a value a pod does not know yet makes it re-read the Secret once, and both
the migration port's handshake and the /internal endpoints follow, in both directions of a rotation."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
import pytest
from aiohttp import web

from kvfleet.serving import httpapi
from kvfleet.serving.credentials import MIGRATION_KEY_KEY, TOKEN_KEY, PoolCredentials, PoolSecrets
from kvfleet.worker.migration.transport import AuthenticationError, Channel, TCPTransport

OLD = PoolSecrets("old-token", b"old-key")
NEW = PoolSecrets("new-token", b"new-key")


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class Secret:
    """The pool's Secret as the API server holds it (None: deleted); counts reads."""

    def __init__(self, secrets: PoolSecrets | None) -> None:
        self.secrets, self.reads = secrets, 0

    async def __call__(self) -> Mapping[str, str] | None:
        self.reads += 1
        if self.secrets is None:
            return None
        return {TOKEN_KEY: self.secrets.token, MIGRATION_KEY_KEY: self.secrets.migration_key.decode()}


def holder(current: PoolSecrets, secret: Secret | None = None, clock: Clock | None = None) -> PoolCredentials:
    return PoolCredentials(current, secret, grace_s=60, miss_refresh_s=1, clock=clock or Clock())


# ------------------------------------------------------------------------------------ the holder


def test_a_rotation_keeps_the_previous_values_for_the_grace_period_only() -> None:
    clock = Clock()
    creds = holder(OLD, clock=clock)
    assert creds.rotate(NEW) and not creds.rotate(NEW)
    assert (creds.token, creds.migration_key) == ("new-token", b"new-key")  # what a pod sends: the newest
    assert creds.accepts_token("new-token") and creds.accepts_token("old-token")
    assert creds.migration_keys() == (b"new-key", b"old-key")
    clock.now_s += 59.9
    assert creds.accepts_token("old-token")
    clock.now_s += 0.2
    assert not creds.accepts_token("old-token") and creds.accepts_token("new-token")
    assert creds.migration_keys() == (b"new-key",)
    assert not creds.accepts_token("") and not creds.accepts_token("new-token ")


def test_secrets_never_print_and_an_old_secret_keys_the_handshake_with_its_token() -> None:
    assert "old" not in repr(OLD) and "old" not in str(OLD)
    assert PoolSecrets.from_data({TOKEN_KEY: "t"}) == PoolSecrets("t", b"t")
    with pytest.raises(ValueError):
        PoolSecrets.from_data({MIGRATION_KEY_KEY: "k"})


def test_refresh_follows_the_secret_and_keeps_values_while_it_is_gone() -> None:
    secret = Secret(OLD)
    creds = holder(OLD, secret)
    assert not asyncio.run(creds.refresh()) and creds.token == "old-token"
    secret.secrets = None  # deleted: the operator makes it again within an epoch
    assert not asyncio.run(creds.refresh()) and creds.token == "old-token"
    secret.secrets = NEW
    assert asyncio.run(creds.refresh()) and creds.token == "new-token" and creds.rotations == 1


def test_a_miss_rereads_the_secret_at_most_once_a_second() -> None:
    clock, secret = Clock(), Secret(OLD)
    creds = holder(OLD, secret, clock)
    assert not asyncio.run(creds.refresh_after_miss()) and secret.reads == 1
    assert not asyncio.run(creds.refresh_after_miss()) and secret.reads == 1  # a peer hammering a wrong token
    clock.now_s += 1.0
    secret.secrets = NEW
    assert asyncio.run(creds.refresh_after_miss()) and secret.reads == 2 and creds.token == "new-token"


def test_a_failed_read_keeps_the_values() -> None:
    async def broken() -> Mapping[str, str] | None:
        raise ConnectionError("the API server is restarting")

    creds = PoolCredentials(OLD, broken)
    assert not asyncio.run(creds.refresh()) and creds.token == "old-token"


def test_from_env_reads_the_secret_only_in_a_pod() -> None:
    made: list[tuple[str, str]] = []

    def reader(namespace: str, name: str) -> Secret:
        made.append((namespace, name))
        return Secret(NEW)

    assert PoolCredentials.from_env({}, reader) is None
    local = PoolCredentials.from_env({"KVFLEET_POOL_TOKEN": "t"}, reader)
    assert local is not None and local.migration_key == b"t" and not made
    pod = PoolCredentials.from_env({"KVFLEET_POOL_TOKEN": "t", "KVFLEET_MIGRATION_KEY": "k",
                                    "KVFLEET_POOL_SECRET": "p-token", "POD_NAMESPACE": "ns"}, reader)
    assert pod is not None and pod.migration_key == b"k" and made == [("ns", "p-token")]
    assert asyncio.run(pod.refresh()) and pod.token == "new-token"


# ------------------------------------------------------------------------- the migration handshake


async def handshake(client: PoolCredentials, server: PoolCredentials) -> None:
    """One connection from `client` to a migration port keyed by `server`, and a frame each way."""

    async def echo(channel: Channel) -> None:
        frame = await channel.recv(5)
        await channel.send({"echo": frame.header["n"]})

    listener = await TCPTransport(server).listen("127.0.0.1", 0, echo)
    try:
        channel = await TCPTransport(client).connect(f"127.0.0.1:{listener.port}")
        try:
            await channel.send({"n": 7})
            assert (await channel.recv(5)).header == {"echo": 7}
        finally:
            channel.close()
    finally:
        await listener.close()


def test_a_peer_one_rotation_behind_still_migrates_within_the_grace_period() -> None:
    clock = Clock()
    server = holder(OLD, clock=clock)
    server.rotate(NEW)
    asyncio.run(handshake(holder(OLD), server))  # the client has not heard of the rotation yet
    clock.now_s += 61
    with pytest.raises(AuthenticationError):
        asyncio.run(handshake(holder(OLD), server))


def test_a_peer_that_heard_of_the_rotation_first_makes_the_other_reread_the_secret() -> None:
    secret = Secret(NEW)
    stale_server = holder(OLD, secret)
    asyncio.run(handshake(holder(NEW), stale_server))
    assert secret.reads == 1 and stale_server.token == "new-token"
    # And the other way round: a stale client refused by a rotated server re-reads and retries.
    server = holder(NEW)
    stale_client = holder(OLD, Secret(NEW), Clock())
    server.grace_s = 0.0  # no grace: the old key is refused outright
    asyncio.run(handshake(stale_client, server))
    assert stale_client.migration_key == b"new-key"


def test_a_peer_with_neither_key_is_refused() -> None:
    with pytest.raises(AuthenticationError):
        asyncio.run(handshake(holder(PoolSecrets("x", b"x"), Secret(None)), holder(NEW, Secret(NEW))))


# --------------------------------------------------------------------------- the /internal endpoints


async def internal_status(server: PoolCredentials, token: str) -> int:
    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[httpapi.openai_errors(lambda _: None), httpapi.pool_token_auth(server)])
    app.router.add_get("/internal/requests", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session, session.get(
                f"http://127.0.0.1:{port}/internal/requests", headers=httpapi.bearer(token)) as resp:
            return resp.status
    finally:
        await runner.cleanup()


def test_internal_endpoints_take_the_previous_token_in_grace_and_learn_a_new_one_on_a_miss() -> None:
    clock, secret = Clock(), Secret(NEW)
    server = holder(OLD, secret, clock)
    assert asyncio.run(internal_status(server, "old-token")) == 200 and secret.reads == 0
    assert asyncio.run(internal_status(server, "new-token")) == 200 and secret.reads == 1  # learnt on the miss
    assert asyncio.run(internal_status(server, "old-token")) == 200  # previous, in grace
    clock.now_s += 61
    assert asyncio.run(internal_status(server, "old-token")) == 401
    assert asyncio.run(internal_status(server, "new-token")) == 200
