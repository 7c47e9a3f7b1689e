"""gangd.protocol.pmi without sockets: every PMI-1 query gets the response
name MPICH waits for, and nothing a rank sends makes the parser do more
than answer, refuse, or declare the connection broken (PMIError)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gangd.protocol import pmi

# Every query of MPICH's pmi-1.2.txt that gangd does not serve, with the response MPICH compares against.
# (``cmd=spawn`` on one line is not how MPICH spawns, ``mcmd=spawn`` is: it is not served either.)
NOT_SERVED = {"spawn": "spawn_result", "initack": "initack", "singinit": "singinit_info",
              "create_kvs": "newkvs", "destroy_kvs": "kvs_destroyed", "getbyidx": "getbyidx_results"}


def commands_of(data: bytes) -> list[pmi.Command]:
    return [pmi.command(fields) for fields in pmi.Reader().feed(data)]


@pytest.mark.parametrize("cmd", sorted(NOT_SERVED))
def test_each_query_gangd_does_not_serve_is_answered_under_its_response_name(cmd):
    (command,) = commands_of(f"cmd={cmd} pmi_version=1\n".encode())
    assert isinstance(command, pmi.Unsupported)
    assert command.reply() == f"cmd={NOT_SERVED[cmd]} rc=-1 msg={cmd}_is_not_supported_by_gangd\n".encode()


def test_every_query_has_a_response_name():
    served = {"init", "finalize", "put", "get", "barrier_in", "publish_name", "lookup_name", "unpublish_name", *pmi.QUERIES}
    assert set(pmi.RESPONSES) == served | set(NOT_SERVED)


def spawn_text(segments: list[list[str]], preput: int = 0) -> bytes:
    """A spawn as MPICH's PMIU_cmd_output_v1_mcmd writes it (values may hold spaces)."""
    lines = ["mcmd=spawn"]
    for i, args in enumerate(segments):
        if i:
            lines.append("mcmd=spawn")
        lines += ["nprocs=2", "execname=/usr/bin/python3", f"totspawns={len(segments)}", f"spawnssofar={i + 1}", f"argcnt={len(args)}"]
        lines += [f"arg{j + 1}={a}" for j, a in enumerate(args)]
        if i == 0:
            lines.append(f"preput_num={preput}")
            lines += [f"preput_key_{k}=PARENT_ROOT_PORT_NAME\npreput_val_{k}=tag#0$x$" for k in range(preput)]
        lines += ["info_num=0", "endcmd"]
    return ("\n".join(lines) + "\n").encode()


SPAWNED = pmi.Spawn(
    (pmi.Segment(("/usr/bin/python3", "-c", "print('a b')"), 2), pmi.Segment(("/usr/bin/python3", "x"), 2)),
    (("PARENT_ROOT_PORT_NAME", "tag#0$x$"),),
)


def test_spawn_of_many_lines_is_one_command_with_each_segment_and_the_preput_keys():
    data = spawn_text([["-c", "print('a b')"], ["x"]], preput=1) + b"cmd=get_maxes\n"
    spawn, after = commands_of(data)
    assert spawn == SPAWNED
    assert spawn.nprocs == 4
    assert after == pmi.Query("get_maxes")  # the connection goes on


def test_spawn_split_anywhere_across_reads_is_the_same_command():
    data = spawn_text([["-c", "print('a b')"], ["x"]], preput=1)
    for cut in range(1, len(data)):
        reader = pmi.Reader()
        got = reader.feed(data[:cut]) + reader.feed(data[cut:])
        assert [pmi.command(f) for f in got] == [SPAWNED], cut


def info(*pairs: tuple[str, str]) -> tuple[bytes, bytes]:
    """The change that gives a spawn's segment these info keys, as MPICH's simple PMI writes them."""
    lines = [f"info_num={len(pairs)}"] + [f"info_{kind}_{i}={v}" for i, (k, val) in enumerate(pairs) for kind, v in (("key", k), ("val", val))]
    return b"info_num=0", "\n".join(lines).encode()


def test_the_wdir_info_key_is_where_the_spawned_processes_start_and_host_where_they_run():
    data = spawn_text([["a"]]).replace(*info(("host", "n2"), ("wdir", "/srv/w")))
    (spawn,) = commands_of(data)
    assert spawn.segments == (pmi.Segment(("/usr/bin/python3", "a"), 2, "/srv/w", ("n2",)),)
    assert spawn.hosts == ("n2",)


def test_the_host_keys_of_a_spawn_are_one_list_for_all_its_commands_and_path_is_where_the_command_is():
    data = spawn_text([["a"], ["b"]])
    first, second = data.split(b"endcmd\n")[:2]
    data = first.replace(*info(("hosts", "n3, n1:2,n3"))) + b"endcmd\n" + second.replace(*info(("host", "10.0.0.2"), ("soft", "1:4"))) + b"endcmd\n"
    (spawn,) = commands_of(data)
    assert spawn.hosts == ("n3", "n1", "10.0.0.2")  # (Hydra's name:count is the name; an unknown key, soft, is ignored)
    data = spawn_text([["a"]]).replace(b"execname=/usr/bin/python3", b"execname=python3").replace(*info(("path", "/opt/py/bin/")))
    (spawn,) = commands_of(data)
    assert spawn.segments[0].argv == ("/opt/py/bin/python3", "a")


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ((b"nprocs=2", b"nprocs=0"), b"nprocs=0_is_not_a_number_from_1_to_256"),
        ((b"nprocs=2", b"nprocs=257"), b"nprocs=257_is_not_a_number_from_1_to_256"),
        ((b"nprocs=2", b"nprocs=99999999999999"), b"nprocs=99999999999999_is_not_a_number_from_1_to_256"),
        ((b"nprocs=2", b"nprocs=-1"), b"nprocs=-1_is_not_a_number_from_1_to_256"),
        ((b"execname=/usr/bin/python3", b"execname="), b"execname_missing"),
        ((b"argcnt=1", b"argcnt=2"), b"arg2_missing"),
        ((b"argcnt=1", b"argcnt=257"), b"argcnt=257_is_not_a_number_from_0_to_256"),
        ((b"preput_num=0", b"preput_num=17"), b"preput_num=17_is_not_a_number_from_0_to_16"),
        ((b"preput_num=0", b"preput_num=1\npreput_key_0=" + b"k" * 65), b"preput_key_0_is_longer_than_64_bytes_or_holds_a_NUL"),
        ((b"arg1=a", b"arg1=" + b"a" * 4001), b"arg1_is_longer_than_4000_bytes_or_holds_a_NUL"),
        ((b"arg1=a", b"arg1=a\0b"), b"arg1_is_longer_than_4000_bytes_or_holds_a_NUL"),
        (info(("hostfile", "/etc/hosts")), b"the_hostfile_info_key_is_not_served_by_gangd:_name_the_nodes_with_the_host_info_key"),
        (info(("host", " , ")), b"the_host_info_key_names_no_node"),
        (info(("host", ",".join(f"n{i}" for i in range(65)))), b"the_host_info_key_names_65_nodes,_more_than_the_64_gangd_reads"),
        (info(("host", "n1" * 2001)), b"info_val_0_is_longer_than_4000_bytes_or_holds_a_NUL"),
        (info(("host", "n1," + "n" * 256)), b"the_host_info_key_names_a_node_longer_than_255_bytes"),
        ((b"info_num=0", b"info_num=1\ninfo_key_0=host"), b"info_val_0_missing"),
    ],
    ids=["no-procs", "too-many-procs", "absurd-procs", "negative-procs", "no-command", "missing-arg", "too-many-args",
         "too-many-preput", "long-preput-key", "long-arg", "nul-in-arg", "hostfile", "no-host", "too-many-hosts", "long-value", "long-host",
         "host-without-value"],
)
def test_hostile_spawns_are_refused_with_spawn_result_and_a_reason(change, why):
    (fields,) = pmi.Reader().feed(spawn_text([["a"]]).replace(*change))
    with pytest.raises(pmi.Refused) as refused:
        pmi.command(fields)
    assert refused.value.reply() == b"cmd=spawn_result rc=-1 msg=" + why.replace(b"=", b"_") + b"\n"  # (PMI-1 values have no "=")


def test_a_spawn_of_more_processes_than_one_spawn_may_start_in_all_is_refused():
    (fields,) = pmi.Reader().feed(spawn_text([["a"]] * 3).replace(b"nprocs=2", b"nprocs=100"))
    with pytest.raises(pmi.Refused, match="at most 256 processes"):
        pmi.command(fields)


def test_a_spawn_of_too_many_commands_is_refused_and_kept_bounded():
    (fields,) = pmi.Reader().feed(spawn_text([["a"]] * (pmi.SPAWN_SEGMENTS_MAX + 4)))
    assert len(fields.segments) == pmi.SPAWN_SEGMENTS_MAX
    with pytest.raises(pmi.Refused, match="more than 16 commands"):
        pmi.command(fields)


@pytest.mark.parametrize("text", [
    b"mcmd=put\nkvsname=k\nkey=a\nvalue=b c\nendcmd\n",
    b"mcmd=spawn\ncmd=put\nkey=a\nvalue=b c\nendcmd\n",
    b"mcmd=publish_name\nservice=s\nport=p q\nendcmd\n",
])
def test_a_multi_line_command_is_never_taken_for_a_put_or_publish_whose_values_hold_spaces(text):
    """Its values may hold spaces (PMI-1 lines cannot): a put of one would make every later get
    of that key unanswerable, on every node of the job."""
    try:
        (command,) = commands_of(text)
    except pmi.Refused as exc:  # (a spawn without its fields: refused as a spawn, still no put)
        assert exc.reply_cmd == "spawn_result" and text.startswith(b"mcmd=spawn\n")
        return
    assert isinstance(command, pmi.Unsupported)
    assert command.reply().startswith(f"cmd={pmi.RESPONSES[command.cmd]} rc=-1 ".encode())


@pytest.mark.parametrize("count", ["\u00b9", "\u0663", "1\u00b2"])
@pytest.mark.parametrize("key", ["totspawns", "spawnssofar"])
def test_a_spawn_count_in_other_digits_breaks_the_connection_cleanly(key, count):
    """str.isdigit() is true of '¹' (which int() refuses) and '٣': the rank's connection ends as any
    other broken one (PMIError), not by a ValueError out of the reader."""
    with pytest.raises(pmi.PMIError):
        pmi.Reader().feed(f"mcmd=spawn\n{key}={count}\nendcmd\n".encode())


def test_an_oversized_spawn_is_still_one_command_and_memory_stays_bounded():
    data = spawn_text([["x" * 4000] * 40])  # 160 KB of arguments
    reader = pmi.Reader()
    (fields,) = reader.feed(data)
    assert fields["oversized"] == "1"
    assert sum(len(k) + len(v) for segment in fields.segments for k, v in segment.items()) <= pmi.MAX_MCMD + 100
    with pytest.raises(pmi.Refused) as refused:
        pmi.command(fields)
    assert refused.value.reply().startswith(b"cmd=spawn_result rc=-1 msg=the_spawn_command_is_longer_than_65536_bytes")


def test_name_service_commands_and_their_limits():
    service, port = "s" * pmi.SERVICE_MAX, "p" * pmi.PORT_MAX
    assert commands_of(f"cmd=publish_name service={service} port={port}\n".encode()) == [pmi.Publish(service, port)]
    assert commands_of(b"cmd=lookup_name service=ocean\n") == [pmi.Lookup("ocean")]
    assert commands_of(b"cmd=unpublish_name service=ocean\n") == [pmi.Unpublish("ocean")]
    for text, reply in [
        (f"cmd=publish_name service={service}x port=p", b"cmd=publish_result rc=-1 msg=service_longer_than_256_bytes\n"),
        (f"cmd=publish_name service=s port={port}p", b"cmd=publish_result rc=-1 msg=port_longer_than_1023_bytes\n"),
        ("cmd=publish_name service=s", b"cmd=publish_result rc=-1 msg=port_missing\n"),
        ("cmd=lookup_name", b"cmd=lookup_result rc=-1 msg=service_missing\n"),
        ("cmd=unpublish_name servic=s", b"cmd=unpublish_result rc=-1 msg=service_missing\n"),
        (f"cmd=lookup_name service={service}x", b"cmd=lookup_result rc=-1 msg=service_longer_than_256_bytes\n"),
    ]:
        (fields,) = pmi.Reader().feed(text.encode() + b"\n")
        with pytest.raises(pmi.Refused) as refused:
            pmi.command(fields)
        assert refused.value.reply() == reply, text


NAMES = sorted({*pmi.RESPONSES, "abort", "mput", "keyval_cache", "barrier_out", "nonsense"})
values = st.one_of(st.text(max_size=40), st.text(min_size=1000, max_size=1300), st.binary(max_size=60).map(lambda b: b.decode("latin-1")))
keys = st.one_of(st.sampled_from(["service", "port", "key", "value", "kvsname", "exitcode", "totspawns", "spawnssofar"]), st.text(max_size=10))


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(NAMES), fields=st.dictionaries(keys, values, max_size=6), junk=st.binary(max_size=200), mcmd=st.booleans())
def test_hostile_lines_are_answered_refused_or_end_the_connection(name, fields, junk, mcmd):
    """Any command name with unknown, missing, oversized or binary values, and junk after it."""
    body = " ".join(f"{k}={v}" for k, v in fields.items())
    head = f"mcmd={name}\n" + "\n".join(f"{k}={v}" for k, v in fields.items()) + "\nendcmd" if mcmd else f"cmd={name} {body}"
    reader = pmi.Reader()
    try:
        parsed = reader.feed(head.encode("utf-8", "surrogateescape") + b"\n" + junk + b"\n")
    except pmi.PMIError:
        return  # the connection is dropped: the rank sent what is not PMI-1
    assert len(reader._buf) <= pmi.MAX_LINE
    for got in parsed:
        try:
            command = pmi.command(got)
        except pmi.Refused as exc:
            reply = exc.reply()
        else:
            if isinstance(command, pmi.Unsupported):
                reply = command.reply()
            elif isinstance(command, pmi.Publish):
                assert 0 < len(command.service.encode()) <= pmi.SERVICE_MAX and 0 < len(command.port.encode()) <= pmi.PORT_MAX
                continue
            elif isinstance(command, pmi.Lookup | pmi.Unpublish):
                assert 0 < len(command.service.encode()) <= pmi.SERVICE_MAX
                continue
            elif isinstance(command, pmi.Spawn):
                assert 1 <= command.nprocs <= pmi.SPAWN_NPROCS_MAX and 1 <= len(command.segments) <= pmi.SPAWN_SEGMENTS_MAX
                assert all(s.argv[0] and len(s.argv) <= pmi.SPAWN_ARGS_MAX + 1 for s in command.segments)
                continue
            else:
                continue
        # a reply is one line, under a response name when the query has one
        assert reply.endswith(b"\n") and reply.count(b"\n") == 1 and len(reply) < 400
        cmd = got.get("mcmd") or got.get("cmd")
        if cmd in pmi.RESPONSES:
            assert reply.startswith(f"cmd={pmi.RESPONSES[cmd]} rc=-1 ".encode()), (got, reply)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=1, max_size=3 * pmi.MAX_LINE))
def test_random_bytes_never_grow_the_reader_past_its_bounds(data):
    reader = pmi.Reader()
    try:
        for i in range(0, len(data), 997):
            reader.feed(data[i:i + 997])
    except pmi.PMIError:
        return
    assert len(reader._buf) <= pmi.MAX_LINE and reader._mcmd_bytes <= len(data) + 1
