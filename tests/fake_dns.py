"""A DNS server on 127.0.0.1 for the tests of SRV discovery (wire/discovery.py):
it answers SRV questions from a table the test changes as it goes, and
SERVFAIL for a name the test marks failing, as a cluster DNS server does in
its bad minute. Made with dnspython's own messages, over UDP."""

from __future__ import annotations

import asyncio

import dns.asyncresolver
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class FakeDns(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.records: dict[str, list[tuple[str, int]]] = {}  # SRV name -> (target, port) of each record
        self.failing: set[str] = set()
        self.asked = 0
        self.transport: asyncio.DatagramTransport | None = None

    async def start(self) -> dns.asyncresolver.Resolver:
        """Serving; a resolver that asks it alone."""
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: self, local_addr=("127.0.0.1", 0))
        self.transport = transport
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = ["127.0.0.1"]
        resolver.port = transport.get_extra_info("sockname")[1]
        resolver.cache = None
        return resolver

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.asked += 1
        query = dns.message.from_wire(data)
        answer = dns.message.make_response(query)
        [question] = query.question
        name = question.name.to_text(omit_final_dot=True)
        if name in self.failing:
            answer.set_rcode(dns.rcode.SERVFAIL)
        elif name not in self.records:
            answer.set_rcode(dns.rcode.NXDOMAIN)
        else:
            texts = [f"0 10 {port} {target}." for target, port in self.records[name]]
            answer.answer.append(dns.rrset.from_text_list(question.name, 30, dns.rdataclass.IN,
                                                          dns.rdatatype.SRV, texts))  # fmt: skip
        self.transport.sendto(answer.to_wire(), addr)
