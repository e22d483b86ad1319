"""Two asyncio patterns the worker and the router both need when one request is several samples (`n`).

`gather_all` starts every awaitable and returns their results, or raises the first error with the
others cancelled and finished (so the streams they were reading can be closed without "generator
already running"); `merged` reads several async streams at once and yields each item with the index
of its stream, in the order they come.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


async def gather_all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Every result, or the first error with the others cancelled and done."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(streams: Sequence[tuple[int, AsyncIterator[T]]]) -> AsyncGenerator[tuple[int, T], None]:
    """The items of the streams as they come, each with its stream's index; the first error a stream
    raises ends it all. One stream is read in place, in order."""
    if len(streams) == 1:
        index, only = streams[0]
        async for value in only:
            yield index, value
        return
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for value in stream:
                await queue.put((index, value))
        except Exception as err:  # the reader raises it
            await queue.put(err)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
