"""A local host that counts the bytes read from log files (``*.log``, ``*.log.1``): what reading a role's log costs."""

from __future__ import annotations

from pdctl.statemachine.hosts import LocalHost


class CountingHost(LocalHost):
    """:class:`LocalHost`, adding to :attr:`read` the bytes each read of a log file returns."""

    def __init__(self) -> None:
        super().__init__()
        self.read = 0

    def _count(self, path: str, data: bytes) -> bytes:
        if ".log" in path.rsplit("/", 1)[-1]:
            self.read += len(data)
        return data

    def read_file(self, path: str) -> bytes:
        return self._count(path, super().read_file(path))

    def read_tail(self, path: str, max_bytes: int) -> bytes:
        return self._count(path, super().read_tail(path, max_bytes))

    def read_from(self, path: str, offset: int, max_bytes: int) -> tuple[bytes, int]:
        data, size = super().read_from(path, offset, max_bytes)
        return self._count(path, data), size
