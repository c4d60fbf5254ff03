"""A share that refuses locks, as a cluster's can: a FUSE passthrough of one folder whose ``flock``
and ``fcntl`` locks fail (Lustre mounted ``noflock`` answers ENOSYS to every flock; SFTP has no
locks) and whose rename of a folder onto an existing one fails with EPERM, as sshfs's does (POSIX
says ENOTEMPTY). Everything else goes to the folder below.

    python tests/noflock_fs.py SOURCE MOUNTPOINT      # in the foreground; fusermount3 -u MOUNTPOINT ends it

Needs ``mfusepy`` (PyPI, the test extra) and libfuse 3 (Debian's ``fuse3``, which sshfs brings),
/dev/fuse and fusermount3. Used by tests/test_shared_fs.py.
"""

from __future__ import annotations

import errno
import os
import stat
import sys

import mfusepy as fuse


class NoLockPassthrough(fuse.Operations):
    """SOURCE's files under the mount point; locks refused."""

    use_ns = True

    def __init__(self, source: str):
        self.source = os.path.realpath(source)

    def _path(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    # -- what a cluster's share refuses ---------------------------------------------------------
    def flock(self, path, fh, op):
        raise fuse.FuseOSError(errno.ENOSYS)

    def lock(self, path, fh, cmd, lock):
        raise fuse.FuseOSError(errno.ENOSYS)

    def rename(self, old, new):
        target = self._path(new)
        if os.path.isdir(self._path(old)) and os.path.isdir(target):
            raise fuse.FuseOSError(errno.EPERM)  # sshfs: SFTP's rename does not replace a folder
        os.rename(self._path(old), target)

    # -- the rest: passed through ---------------------------------------------------------------
    def access(self, path, amode):
        if not os.access(self._path(path), amode):
            raise fuse.FuseOSError(errno.EACCES)
        return 0

    def chmod(self, path, mode):
        os.chmod(self._path(path), mode)
        return 0

    def chown(self, path, uid, gid):
        os.chown(self._path(path), uid, gid)
        return 0

    def create(self, path, mode, fi=None):
        return os.open(self._path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        os.fdatasync(fh) if datasync else os.fsync(fh)
        return 0

    def getattr(self, path, fh=None):
        st = os.fstat(fh) if fh is not None else os.lstat(self._path(path))
        return {key: getattr(st, key) for key in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size")} | {
            key: getattr(st, f"{key}_ns") for key in ("st_atime", "st_mtime", "st_ctime")}  # use_ns: nanoseconds

    def link(self, target, source):
        os.link(self._path(source), self._path(target))
        return 0

    def mkdir(self, path, mode):
        os.mkdir(self._path(path), mode)
        return 0

    def open(self, path, flags):
        return os.open(self._path(path), flags)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._path(path))]

    def readlink(self, path):
        return os.readlink(self._path(path))

    def release(self, path, fh):
        os.close(fh)
        return 0

    def rmdir(self, path):
        os.rmdir(self._path(path))
        return 0

    def statfs(self, path):
        st = os.statvfs(self._path(path))
        return {key: getattr(st, key) for key in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                                  "f_files", "f_flag", "f_frsize", "f_namemax")}

    def symlink(self, target, source):
        os.symlink(source, self._path(target))
        return 0

    def truncate(self, path, length, fh=None):
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._path(path), length)
        return 0

    def unlink(self, path):
        os.unlink(self._path(path))
        return 0

    def utimens(self, path, times=None):
        os.utime(self._path(path), ns=times)
        return 0

    def write(self, path, data, offset, fh):
        return os.pwrite(fh, data, offset)


def main(argv: list[str]) -> int:
    source, mountpoint = argv
    if not stat.S_ISDIR(os.stat(source).st_mode):
        raise SystemExit(f"{source} is not a folder")
    fuse.FUSE(NoLockPassthrough(source), mountpoint, foreground=True, nothreads=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
