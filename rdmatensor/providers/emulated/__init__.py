"""What the emulated providers (shm, tcp) share: the authenticated stream, the write header, the waits."""
