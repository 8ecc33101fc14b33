"""The fleet: what each replica holds, forwarding to the holder, and the peers' views of the whole fleet."""
