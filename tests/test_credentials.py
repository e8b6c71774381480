"""Key files, key IDs and the metrics token, as the daemons read and use them.

``--psk-file`` holds one key (the default, ID ``""``) or a key table
(docs/protocol.md §5); a Spark side picks its key with ``--key-id``;
``--metrics-token-file`` guards ``/metrics`` with a bearer token of its own,
with or without a key; ``--principal-rate`` caps principals' draws.
"""

from __future__ import annotations

import argparse
import asyncio
import urllib.error

import pytest
from prometheus_client import CollectorRegistry, Counter

from pp1wire.apps import keys, metrics, settings, spark, worker
from pp1wire.apps.launch import worker_process
from pp1wire.apps.settings import SettingsError
from pp1wire.wire.principals import PrincipalPolicy

from . import cli

TABLE = "pp1-keys-v1\n# the operator's two clients\nclient {c}\n\nother {o}\n- {d}\n"
C, OTHER, D = "c" * 20, "o" * 24, "d" * 16


def _flags(**kw: object) -> argparse.Namespace:
    base = {
        "vocab": 16,
        "vocab_hash": 0,
        "row_entries": None,
        "target_identity": "t",
        "psk_file": None,
        "key_id": "",
    }
    return argparse.Namespace(**{**base, **kw})


def test_a_single_key_file_is_the_default_key_and_a_table_names_each(tmp_path):
    single = tmp_path / "one.key"
    single.write_bytes(b"  \t" + b"k" * 16 + b"\r\n")  # surrounding whitespace stripped
    assert keys.read_keys(str(single)) == {"": b"k" * 16}
    table = tmp_path / "keys"
    table.write_text(TABLE.format(c=C, o=OTHER, d=D))
    want = {"client": C.encode(), "other": OTHER.encode(), "": D.encode()}
    assert keys.read_keys(str(table)) == want
    # A worker holds them all; a Spark side one, the one its --key-id names.
    fields = keys.link_fields(_flags(psk_file=str(table)), worker=True)
    assert fields["psk"] is None
    assert dict(fields["keys"]) == keys.read_keys(str(table))
    mine = keys.link_fields(_flags(psk_file=str(table), key_id="client"))
    assert (mine["psk"], mine["key_id"], mine["keys"]) == (C.encode(), "client", ())
    assert keys.link_fields(_flags(psk_file=str(table), key_id="-"))["psk"] == D.encode()
    # A single-key file is sent under whatever ID the worker's table gives it.
    theirs = keys.link_fields(_flags(psk_file=str(single), key_id="client"))
    assert (theirs["psk"], theirs["key_id"]) == (b"k" * 16, "client")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("pp1-keys-v1\nclient\n", "a key table line is: ID KEY"),
        ("pp1-keys-v1\nclient short\n", "a key needs at least 16 bytes"),
        (f"pp1-keys-v1\nclient {C}\nclient {OTHER}\n", "given twice"),
        (f"pp1-keys-v1\nbad/id {C}\n", "not a key ID"),
        ("pp1-keys-v1\n# nothing\n", "a key table with no key"),
        ("short", "a key needs at least 16 bytes"),
    ],
)
def test_a_bad_key_file_is_one_clear_error(tmp_path, text, says):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(SettingsError, match=says):
        keys.read_keys(str(path))


def test_a_key_id_the_table_lacks_or_without_a_file_is_refused(tmp_path):
    table = tmp_path / "keys"
    table.write_text(TABLE.format(c=C, o=OTHER, d=D))
    with pytest.raises(SettingsError, match="no key ID 'nobody'"):
        keys.link_fields(_flags(psk_file=str(table), key_id="nobody"))
    with pytest.raises(SettingsError, match="--key-id names a key: give --psk-file"):
        keys.link_fields(_flags(key_id="client"))


def test_pp1_spark_connects_under_its_key_id_to_a_worker_holding_a_table(tmp_path):
    table = tmp_path / "keys"
    table.write_text(TABLE.format(c=C, o=OTHER, d=D))
    mine = tmp_path / "client.key"
    mine.write_text(C + "\n")
    with worker_process("--psk-file", str(table), vocab=16) as running:
        ok = cli.spark(
            running.address, 16, "--psk-file", mine, "--key-id", "client", "--requests", "1",
            "--max-tokens", "4", "--json", timeout=60,
        )  # fmt: skip
        assert ok.returncode == 0, ok.stderr
        wrong = cli.spark(
            running.address, 16, "--psk-file", mine, "--key-id", "other", "--requests", "1",
            "--connect-timeout", "1", timeout=60,
        )  # fmt: skip
        assert wrong.returncode == 1, wrong.stderr
        assert "AUTH_FAILED" in wrong.stderr, wrong.stderr


def test_principal_rate_flags_make_the_policy():
    args = worker.build_parser().parse_args(
        ["--principal-rate", "10", "client=off", "=5", "--ipv6-prefix", "56"]
    )
    policy = worker.policy_from(args)
    assert policy == PrincipalPolicy(rate=10.0, rates={"client": None, "": 5.0}, ipv6_prefix=56)
    assert worker.policy_from(worker.build_parser().parse_args([])) == PrincipalPolicy()
    twice = worker.build_parser().parse_args(["--principal-rate", "a=1", "a=2"])
    with pytest.raises(SettingsError, match="key ID 'a' twice"):
        worker.policy_from(twice)
    with pytest.raises(argparse.ArgumentTypeError, match="is not a rate"):
        settings.principal_rate("client=0")


def test_principal_rates_come_from_the_toml_file_too(tmp_path):
    config = tmp_path / "worker.toml"
    config.write_text('principal_rate = ["10", "client=off"]\n')
    args = settings.parse(worker.build_parser(), ["--config", str(config)], environ={})
    assert worker.policy_from(args) == PrincipalPolicy(rate=10.0, rates={"client": None})
    config.write_text("principal_rate = 10\n")  # a list of strings, not a number
    with pytest.raises(SettingsError, match="is not a list of strings"):
        settings.parse(worker.build_parser(), ["--config", str(config)], environ={})


def test_the_metrics_endpoint_with_a_token_answers_only_its_bearer(tmp_path):
    # Before: /metrics had no credential of its own, and with --psk-file a metrics
    # listener beyond loopback was allowed and served anyone. Now a token guards it.
    path = tmp_path / "token"
    path.write_text("t0ken-of-sixteen-or-more\n")
    token = keys.read_token(str(path))
    reg = CollectorRegistry()
    Counter("pp1_x", "X.", registry=reg).inc()

    async def fetch(*headers: bytes) -> str:
        server = await metrics.serve(reg, "127.0.0.1", 0, token=token)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"".join(headers) + b"\r\n")
        page = (await reader.read()).decode()
        writer.close()
        server.close()
        return page

    assert asyncio.run(fetch()).startswith("HTTP/1.1 401 Unauthorized")
    wrong = asyncio.run(fetch(b"Authorization: Bearer nope-nope-nope-nope\r\n"))
    assert wrong.startswith("HTTP/1.1 401")
    assert "pp1_x" not in wrong
    page = asyncio.run(fetch(b"authorization: bearer t0ken-of-sixteen-or-more\r\n"))
    assert page.startswith("HTTP/1.1 200 OK")
    assert "pp1_x_total 1.0" in page
    path.write_text("short")
    with pytest.raises(SettingsError, match="at least 16 printable"):
        keys.read_token(str(path))


def test_a_worker_serves_metrics_beyond_loopback_with_its_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("a-metrics-token-0123456789")
    key = tmp_path / "psk"
    key.write_text("k" * 32)
    flags = ("--psk-file", str(key), "--metrics-host", "0.0.0.0", "--metrics-port", "0")
    with worker_process(*flags, "--metrics-token-file", str(token), vocab=16) as running:
        assert running.metrics is not None
        address = "127.0.0.1:" + running.metrics.rsplit(":", 1)[1]
        with pytest.raises(urllib.error.HTTPError) as refused:
            metrics.scrape_page(address)
        assert refused.value.code == 401
        refused.value.close()
        assert "pp1_worker_" in metrics.scrape_page(address, token=b"a-metrics-token-0123456789")


# -- the summary's warning of faults the reply timeout does not explain ---------------------


def test_faults_the_reply_timeout_explains_never_warn_and_others_warn_past_the_floor():
    timeout = "reply_timeout"
    assert spark.fault_warning({}, 1000) is None
    # Reply and answer timeouts are this side's own deadline: however many, at any row.
    assert spark.fault_warning({(0, timeout): 500, (3, "answer_timeout"): 400}, 1000) is None
    # Others count: below 1 % of the proposals (here 10), or below 3, no warning.
    assert spark.fault_warning({(1, "internal"): 9, (0, timeout): 50}, 1000) is None
    assert spark.fault_warning({(1, "internal"): 2}, 10) is None
    line = spark.fault_warning({(1, "internal"): 7, (0, "connection_lost"): 3}, 1000)
    assert line is not None
    assert line.startswith("10 of 1000 proposals ended by a fault the reply timeout does not")
    assert "(row 0: 3, row 1: 7)" in line
    assert "pp1_faults_by_row_total" in line
    assert spark.fault_warning({(2, "internal"): 3}, 10) is not None  # the floor of 3
