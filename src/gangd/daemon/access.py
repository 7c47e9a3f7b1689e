"""Who may do what to a job, and the checks on request arguments that many handlers share.

A leaf module (it imports nothing of the daemon's), so handlers, the
coordinator and the checkpoint coordinator all check the same way without
importing one another.
"""

from __future__ import annotations

from ..rpc import RemoteError


def integer(args: dict, key: str) -> int:
    """``args[key]`` as an integer (a bool is not one), or bad_request."""
    value = args.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RemoteError("bad_request", f"{key!r} must be an integer, not {value!r}")
    return value


def optional_integer(args: dict, key: str, message: str | None = None) -> int | None:
    value = args.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise RemoteError("bad_request", message or f"{key!r} must be an integer")
    return value


def permission_check(record: dict, cred: dict, action: str) -> None:
    """Only a job's owner or root may ``action`` it."""
    if cred["uid"] in (0, record["owner_uid"]):
        return
    raise RemoteError(
        "permission_denied",
        f"job {record['id']} belongs to {record['owner']}; only its owner or root may {action} it",
    )


def check_may_resume(record: dict, cred: dict) -> None:
    """A job root suspended stays suspended until root resumes it: the owner's
    resume would undo an administrator's decision (a job stopped to free the
    machine, or under investigation)."""
    held_uid = record.get("held_uid")
    if held_uid is None and record.get("held") == "root":  # (suspended before gangd recorded the uid)
        held_uid = 0
    if held_uid == 0 and cred["uid"] != 0:
        raise RemoteError(
            "permission_denied",
            f"job {record['id']} was suspended by root ({record.get('held') or 'root'}); only root may resume it",
        )


async def job_for(table, args: dict, cred: dict, action: str) -> dict:
    """The record of the job ``args["job"]`` names, if ``cred`` may ``action`` it.

    Read from etcd if not cached: submitted a moment ago through another
    node, or ended long ago and in the history."""
    job_id = integer(args, "job")
    record = await table.fetch(job_id)
    if record is None:
        raise RemoteError("no_such_job", f"no job {job_id}")
    permission_check(record, cred, action)
    return record
