"""Who holds a port, by address: the pure readers of ``/proc/net/tcp*`` and the rule that says which holder is in the
way of a bind (:mod:`pdctl.statemachine.ports`).

``fixtures/proc_net_tcp.txt`` and ``proc_net_tcp6.txt`` were captured on a little-endian x86_64 host with listeners on
127.0.0.2:30001, 0.0.0.0:30010, [::1]:30020, [::ffff:127.0.0.1]:30110 and [::]:30120 (IPV6_V6ONLY); row 3 of the IPv4
table, an established connection (state 01) from 127.0.0.1:30010, was added by hand: it listens on nothing.
"""

from __future__ import annotations

import ipaddress
import socket
import os
from pathlib import Path

from pdctl.statemachine.ports import Listener, bind_address, in_the_way, local_address, parse_proc_net_tcp

FIX = Path(__file__).parent / "fixtures"


def test_listening_sockets_are_read_with_their_port_and_address_field():
    v4 = parse_proc_net_tcp((FIX / "proc_net_tcp.txt").read_text())
    v6 = parse_proc_net_tcp((FIX / "proc_net_tcp6.txt").read_text())
    assert v4 == {"1879752": (30001, "0200007F"), "1879753": (30010, "00000000")}  # not the established one
    assert v6 == {"1879755": (30110, "0000000000000000FFFF00000100007F"),
                  "1879754": (30020, "00000000000000000000000001000000"),
                  "1879756": (30120, "00000000000000000000000000000000")}
    read = {port: local_address(field, "little") for port, field in [*v4.values(), *v6.values()]}
    assert read == {30001: ipaddress.ip_address("127.0.0.2"), 30010: ipaddress.ip_address("0.0.0.0"),
                    30020: ipaddress.ip_address("::1"), 30110: ipaddress.ip_address("127.0.0.1"),  # (IPv4-mapped)
                    30120: ipaddress.ip_address("::")}


def test_with_connections_a_bound_socket_held_by_a_process_counts_and_one_no_process_holds_does_not():
    # (a connection whose local port was the router's metrics port passed the check: smg then failed to bind it,
    # "Address already in use", after both servers had started)
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    rows = {"0A": "11", "01": "12", "02": "13", "07": "14", "08": "15", "06": "0", "05": "0"}
    table = head + "".join(f"   {i}: 0100007F:{0x7000 + i:04X} 0100007F:9C40 {st} 00000000:00000000 00:00000000 "
                           f"00000000     0        0 {inode} 1 0000000000000000 20 4 30 10 -1\n"
                           for i, (st, inode) in enumerate(rows.items()))
    assert parse_proc_net_tcp(table) == {"11": (0x7000, "0100007F")}
    # LISTEN, ESTABLISHED, SYN_SENT, CLOSE (bound, not connected), CLOSE_WAIT; not TIME_WAIT nor an orphaned FIN_WAIT2
    assert parse_proc_net_tcp(table, connections=True) == {
        inode: (0x7000 + i, "0100007F") for i, inode in enumerate(["11", "12", "13", "14", "15"])}


def test_held_outside_names_a_process_whose_connection_holds_the_port():
    from pdctl.statemachine.hosts import LocalHost
    from pdctl.statemachine.ports import held_outside, listeners

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.socket()
    client.bind(("127.0.0.1", 0))
    port = client.getsockname()[1]
    client.connect(server.getsockname())
    try:
        assert listeners(LocalHost(), {port}) == []  # (what status reads: listeners only)
        held = held_outside(LocalHost(), {port: None}, [])
        assert [(x.port, x.pid, x.listening) for x in held] == [(port, os.getpid(), False)], held
        assert held_outside(LocalHost(), {port: "127.0.0.2"}, []) == []  # (another specific address: Linux binds it)
    finally:
        client.close()
        server.close()


def test_an_address_is_read_in_the_hosts_byte_order_and_not_at_all_without_it():
    # the kernel prints each 32-bit word as a number in the CPU's order: a big-endian host prints 127.0.0.2 as 7F000002
    assert local_address("7F000002", "big") == local_address("0200007F", "little") == ipaddress.ip_address("127.0.0.2")
    assert local_address("0200007F", "big") == ipaddress.ip_address("2.0.0.127")
    assert local_address("00000000000000000000000001000000", "big") == ipaddress.ip_address("::100:0")
    assert local_address("0200007F", "") is None  # /sys/kernel/cpu_byteorder unreadable
    assert local_address("0200007", "little") is None and local_address("0200007G", "little") is None


def test_a_holder_on_another_specific_address_is_not_in_the_way_a_wildcard_or_the_same_one_is():
    def holder(*addresses: str) -> Listener:
        return Listener(30001, 4242, "squatter", frozenset(ipaddress.ip_address(a) for a in addresses))

    assert not in_the_way(holder("127.0.0.2"), "127.0.0.1")
    assert not in_the_way(holder("::1"), "127.0.0.1")  # another family's loopback
    assert in_the_way(holder("127.0.0.1"), "127.0.0.1")
    assert in_the_way(holder("0.0.0.0"), "127.0.0.1") and in_the_way(holder("::"), "127.0.0.1")
    assert in_the_way(holder("127.0.0.2", "127.0.0.1"), "127.0.0.1")  # one of its sockets is
    assert in_the_way(holder("127.0.0.2"), None)  # the server binds every address, or pdctl cannot tell which
    assert in_the_way(Listener(30001, None), "127.0.0.1")  # its addresses unknown
    # what each spec address binds: one normalised address, or None (every address, or not known for sure)
    assert [bind_address(h) for h in ("127.0.0.1", "::ffff:127.0.0.2", "[::1]", "0.0.0.0", "::", "", "localhost")] \
        == ["127.0.0.1", "127.0.0.2", "::1", None, None, None, None]


def test_router_listening_compares_the_addresses_its_process_tree_binds_with_the_spec():
    import ipaddress

    from pdctl.statemachine.ports import Listener
    from pdctl.statemachine.service import _router_listening
    from pdctl.statemachine.topology import RouterTopology

    def rt(host):  # noqa: ANN001, ANN202
        return RouterTopology(impl="smg", on="local", host=host, port=30001, prefill=(), decode=(), regular=(), settings={})

    def at(*addrs, pid=7):  # noqa: ANN002, ANN202
        return [Listener(30001, pid, "smg", frozenset(ipaddress.ip_address(a) for a in addrs))]

    host = object()  # (a listener whose PID is the unit's main PID is its own: no process tree read)
    assert _router_listening(host, rt("127.0.0.1"), 7, at("0.0.0.0")) == (["0.0.0.0:30001"], True)
    assert _router_listening(host, rt("127.0.0.1"), 7, at("127.0.0.1")) == (["127.0.0.1:30001"], False)
    assert _router_listening(host, rt("0.0.0.0"), 7, at("0.0.0.0")) == (["0.0.0.0:30001"], False)
    assert _router_listening(host, rt("::"), 7, at("::")) == (["[::]:30001"], False)
    assert _router_listening(host, rt("0.0.0.0"), 7, at("127.0.0.1")) == (["127.0.0.1:30001"], True)
    assert _router_listening(host, rt("localhost"), 7, at("0.0.0.0")) == (["0.0.0.0:30001"], False)  # (a host name)
    assert _router_listening(host, rt("127.0.0.1"), None, at("0.0.0.0")) == ([], False)  # (no unit process)
    assert _router_listening(host, rt("127.0.0.1"), 7, [Listener(30001, 7, "smg", None)]) == ([], False)
