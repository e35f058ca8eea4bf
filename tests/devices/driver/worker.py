"""Runs the cases of ``cases.py`` one at a time, in a process whose CUDA driver is the stand-in.

Protocol: one case name per line on stdin; one JSON line per case on stdout, ``{"ok": true}`` or
``{"ok": false, "error": <traceback>}``. Between cases every workspace of the thread is destroyed
and the stand-in's switches and log are reset.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback
import warnings


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # the cases' prints must not mix with the protocol
    import cases

    import rustws

    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # as strict as the test suite
                getattr(cases, name)()
            reply: dict[str, object] = {"ok": True}
        except BaseException:
            reply = {"ok": False, "error": traceback.format_exc()}
        finally:
            rustws.destroy_all_workspaces_for_current_thread()
            gc.collect()
            cases.DRIVER.reset()
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
