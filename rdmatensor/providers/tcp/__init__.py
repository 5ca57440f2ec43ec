"""tcp: the one-sided contract emulated over a TCP stream, each payload received straight into its slot.

    channel.py  the channel over one TCP connection: no serialization
    inbox.py    what the connection delivers, taken in as a NIC would
    _inbox.c    the inbox's compiled twin
"""
