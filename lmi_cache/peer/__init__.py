"""The peer tier: one server reads KV chunks straight from another server's CPU tier (worker processes).

A chunk moves between peers only through a real transfer engine (Mooncake's
Transfer Engine: TCP here, RDMA or EFA where the hardware is there); the small
control messages (handshake, lookup under a lease, release) go over ZMQ with
msgpack. ``transport`` wraps the engine (importable without it installed),
``protocol`` holds the messages and the identity peers must share,
``server`` answers a rank's peers, ``client`` asks a peer and verifies what it
reads exactly like a remote-store hit. Nothing here imports vLLM.
"""
