"""A submitted record's receipt: whether (and when) it is durable.

:meth:`serving.interaction_log.InteractionLogger.submit` returns one per record.
Request handlers await it before they acknowledge the request to the client;
the logger's writer resolves it after the spool's fsync, or the sender after the
broker's acknowledgement (whichever comes first).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, InvalidStateError


class Receipt:
    """Says when a submitted record is durable: fsynced in the spool or acknowledged by the broker."""

    def __init__(self, durable: bool = False) -> None:
        self._future: Future[bool] = Future()
        if durable:
            self._future.set_result(True)

    def resolve(self) -> None:
        try:
            self._future.set_result(True)
        except InvalidStateError:  # the writer and the broker's acknowledgement may race: first wins
            pass

    @property
    def durable(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float) -> bool:
        """Block until durable; False if ``timeout_s`` passed first."""
        try:
            return self._future.result(timeout_s)
        except TimeoutError:
            return False

    async def wait_async(self, timeout_s: float) -> bool:
        """Await durability without blocking the event loop; False if ``timeout_s`` passed first."""
        if self._future.done():
            return True
        try:  # shield: a timeout must not cancel the record's future, only this wait
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._future)), timeout_s)
            return True
        except TimeoutError:
            return False
