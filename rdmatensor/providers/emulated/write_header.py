"""The header of an emulated write: what shm's completion ring and tcp's stream
carry before (tcp) or instead of (shm, whose payload is already in the mapped
region) the payload, and what the receiver checks as a NIC checks an rkey.
Its C twin is `_write_header.h`."""
import struct

WRITE_HEADER = struct.Struct("<IiIIQQ")   # magic, region, key, imm, offset, length
WRITE_MAGIC = 0x52445457                  # "RDTW"
