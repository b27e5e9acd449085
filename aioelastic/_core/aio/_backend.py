"""Which async library runs us: aioelastic needs anyio's asyncio backend.

Under anyio's trio backend the pieces that talk to asyncio's loop directly — signal
handlers restored exactly (``loop.add_signal_handler``), pipe registrations removable from
another task (``loop.add_reader``), the console's and launcher threads' wake-ups
(``asyncio`` futures) — would fail somewhere in the middle, after workers or temporary
directories were created. So every entry point checks first and refuses with one error.
"""

from __future__ import annotations

import contextvars

import sniffio


def require_asyncio(what: str) -> None:
    """Raise unless the running async library is asyncio.

    Args:
        what: The refused call, for the message (``"start_processes()"``).

    Raises:
        RuntimeError: The caller runs under another library (trio).
    """
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return  # not in async code at all: the call fails on its own, as it would anyway
    if library != "asyncio":
        raise RuntimeError(
            f"aioelastic needs the asyncio backend, but {what} runs under {library}: run it "
            "with anyio.run(main, backend='asyncio') or asyncio.run(main()). The trio "
            "backend is not supported (signals, worker pipes and the launcher threads use "
            "asyncio's event loop)."
        )


def callback_context() -> contextvars.Context:
    """A copy of the current context in which anyio knows that it runs on asyncio.

    anyio finds its backend through sniffio, which outside a task (in a reader callback
    of the event loop) finds none: a callback that starts a task or makes a cancel scope
    runs in a copy of this context instead.
    """
    context = contextvars.copy_context()
    context.run(sniffio.current_async_library_cvar.set, "asyncio")
    return context
