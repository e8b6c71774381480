"""A fork server for ``pp1-spark`` and ``pp1-worker``: each start forks a process that has
already imported them.

The Spark-side suite starts its Spark command once per case, and the command-line
tests start a daemon once per bad flag. A fresh interpreter spends most of such a
start importing numpy, msgspec and pp1wire; here one server imports them once and
each start is a small client (``python -S``, no imports beyond the standard
library's socket) that asks the server to fork a child running the program's
``main`` with the client's arguments, stdout and stderr, and relays the child's
exit status. The child is the program as a fresh process runs it: same code,
same arguments, a new event loop; only the imports (and the server's
environment) are inherited.

Usage: ``python tests/forkserver.py SOCKET`` (prints ``ready``), then per start:
``python -S tests/forkserver.py --client SOCKET [--pp1-worker] [--broken NAME] --
[arguments]`` (``pp1-spark`` unless ``--pp1-worker``). A client that dies (the suite
stops a slow command) takes its child with it.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def client(argv: list[str]) -> int:
    """Ask the server at ``argv[0]`` to run the program; returns its exit status."""
    path, rest = argv[0], argv[1:]
    program = "spark"
    if rest[:1] == ["--pp1-worker"]:
        program, rest = "worker", rest[1:]
    broken = None
    if rest[:1] == ["--broken"]:
        broken, rest = rest[1], rest[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    request = json.dumps({"program": program, "argv": rest, "broken": broken}).encode() + b"\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        socket.send_fds(s, [request], [1, 2])
        status = s.recv(1)
    return status[0] if status else 1


def _child(conn: socket.socket, request: dict[str, object], fds: list[int]) -> None:
    """In the forked child: become the client's program, report its status, exit."""
    import threading
    import traceback

    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)

    def watch() -> None:
        # The client sends nothing more: EOF means it was stopped, and so is this run.
        while conn.recv(1):
            pass
        os._exit(137)

    threading.Thread(target=watch, daemon=True).start()
    code = 1
    try:
        from pp1wire.apps import spark, worker

        broken = request.get("broken")
        if isinstance(broken, str):
            import broken_spark

            broken_spark.BREAKAGES[broken]()
        argv = request["argv"]
        assert isinstance(argv, list)
        main = worker.main if request.get("program") == "worker" else spark.main
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.sendall(bytes([code & 0xFF]))
        finally:
            os._exit(code & 0xFF)


def serve(path: str) -> None:
    """Import both programs once, then fork one child per client until stopped."""
    import signal

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import broken_spark  # noqa: F401 - imported once, for the children

    from pp1wire.apps import spark, worker  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(path)
        srv.listen(64)
        print("ready", flush=True)
        while True:
            conn, _ = srv.accept()
            data, fds = b"", []
            while not data.endswith(b"\n"):
                chunk, got, _, _ = socket.recv_fds(conn, 1 << 16, 2)
                if not chunk:
                    break
                data += chunk
                fds += got
            if data.endswith(b"\n") and len(fds) == 2 and os.fork() == 0:
                srv.close()
                _child(conn, json.loads(data), fds)
            conn.close()
            for fd in fds:
                os.close(fd)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        sys.exit(client(sys.argv[2:]))
    serve(sys.argv[1])
