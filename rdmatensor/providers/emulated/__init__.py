"""What the emulated providers (shm, tcp) share:

    stream_channel.py  emulated one-sided writes on an authenticated connection: the core of both
    write_header.py    the header of an emulated write, checked as a NIC checks an rkey
    _write_header.h    the same header and check for the compiled twins (shm's ring, tcp's inbox)
    waiting.py         how a waiter looks for writes before it sleeps
"""
