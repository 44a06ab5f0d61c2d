//! Refusing a directory another user can change. The gateway runs the cluster's tools
//! in it, writes its lock file there and, as root, hands the cluster's directory to the
//! `postgres` user: in a directory another user can write, that user could plant a
//! symbolic link there first and have a root-owned file truncated or a directory of
//! their choosing handed over. So the directory and every directory above it must belong
//! to this user or root, and be writable by no one else (or be sticky, like `/tmp`,
//! where no one can rename or remove what others made); and the files the gateway opens
//! in it are never opened through a symbolic link.

use std::{
    fs::{File, Metadata, OpenOptions},
    os::unix::fs::{MetadataExt, OpenOptionsExt},
    path::Path,
};

use crate::ClusterError;

/// Whether files owned by `uid` are this process's own (or root's, who can change
/// anything anyway).
fn trusted_owner(uid: u32) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    uid == 0 || uid == unsafe { libc::geteuid() }
}

/// Refuses the `requested` directory when a symbolic link on its way belongs to another
/// user (who could point it anywhere), or when `canonical` (an existing directory, the
/// requested one or the nearest above it that exists, without symbolic links) or a
/// directory above it belongs to another user, or others can create entries in it
/// without the sticky bit keeping them from renaming or removing this user's.
pub(crate) fn check_directory(requested: &Path, canonical: &Path) -> Result<(), ClusterError> {
    for path in requested.ancestors() {
        if let Ok(metadata) = std::fs::symlink_metadata(path)
            && metadata.is_symlink()
            && !trusted_owner(metadata.uid())
        {
            return Err(unsafe_directory(requested, path, foreign(&metadata)));
        }
    }
    for path in canonical.ancestors() {
        let metadata = std::fs::metadata(path).map_err(crate::io_error("inspect", path))?;
        if let Some(reason) = unsafe_reason(&metadata) {
            return Err(unsafe_directory(requested, path, reason));
        }
    }
    Ok(())
}

fn foreign(metadata: &Metadata) -> String {
    format!(
        "belongs to uid {}, neither this user nor root",
        metadata.uid()
    )
}

/// Why another user could change entries of a directory with this `metadata`; `None`
/// when no one else can.
fn unsafe_reason(metadata: &Metadata) -> Option<String> {
    let mode = metadata.mode();
    if !trusted_owner(metadata.uid()) {
        return Some(foreign(metadata));
    }
    // SAFETY: getegid has no preconditions and cannot fail.
    let own_group = metadata.gid() == unsafe { libc::getegid() };
    let others_write = mode & 0o002 != 0;
    let group_writes = mode & 0o020 != 0 && !own_group;
    let sticky = mode & 0o1000 != 0;
    if (others_write || group_writes) && !sticky {
        let who = if others_write {
            "every user".to_owned()
        } else {
            format!("group {}", metadata.gid())
        };
        return Some(format!(
            "can be written by {who} (mode {:o}) and has no sticky bit",
            mode & 0o7777
        ));
    }
    None
}

fn unsafe_directory(directory: &Path, culprit: &Path, reason: String) -> ClusterError {
    ClusterError::UnsafeDirectory {
        directory: directory.to_owned(),
        culprit: culprit.to_owned(),
        reason,
    }
}

/// Refuses `entry` of the checked `directory` when it is a symbolic link or a file
/// another user made (possible in a sticky directory like `/tmp`). `also_trusted` is a
/// further owner accepted for a real directory: the `postgres` user, whose the cluster's
/// directory is when the gateway runs as root.
pub(crate) fn check_entry(
    directory: &Path,
    entry: &Path,
    also_trusted: Option<u32>,
) -> Result<(), ClusterError> {
    let metadata = match std::fs::symlink_metadata(entry) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(crate::io_error("inspect", entry)(error)),
    };
    let owner = metadata.uid();
    let owned = trusted_owner(owner) || (metadata.is_dir() && also_trusted == Some(owner));
    if !owned {
        return Err(unsafe_directory(directory, entry, foreign(&metadata)));
    }
    Ok(())
}

/// Opens `path` with `options`, refusing a symbolic link in its place (`O_NOFOLLOW`), and
/// anything but a regular file with no other hard link: what is written goes to that
/// file and nowhere else. `options` must not truncate: that would happen before the
/// checks (truncate the file returned instead).
pub(crate) fn open_no_follow(
    directory: &Path,
    path: &Path,
    options: &mut OpenOptions,
) -> Result<File, ClusterError> {
    let file = options
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|error| {
            // O_NOFOLLOW on a symbolic link fails with ELOOP.
            if error.raw_os_error() == Some(libc::ELOOP) {
                unsafe_directory(directory, path, "is a symbolic link".to_owned())
            } else {
                crate::io_error("open", path)(error)
            }
        })?;
    let metadata = file.metadata().map_err(crate::io_error("inspect", path))?;
    let reason = if !metadata.is_file() {
        "is not a regular file"
    } else if metadata.nlink() > 1 {
        "has another hard link, which could be another user's file"
    } else {
        return Ok(file);
    };
    Err(unsafe_directory(directory, path, reason.to_owned()))
}

/// [`open_no_follow`], refusing too a file another user owns (possible in a sticky
/// directory like `/tmp`).
pub(crate) fn open_own_file(
    directory: &Path,
    path: &Path,
    options: &mut OpenOptions,
) -> Result<File, ClusterError> {
    let file = open_no_follow(directory, path, options)?;
    let metadata = file.metadata().map_err(crate::io_error("inspect", path))?;
    if !trusted_owner(metadata.uid()) {
        return Err(unsafe_directory(directory, path, foreign(&metadata)));
    }
    Ok(file)
}

/// Gives `path` itself, never what a symbolic link there points to, to `uid` and `gid`.
pub(crate) fn give_to(path: &Path, uid: u32, gid: u32) -> Result<(), ClusterError> {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid)).map_err(crate::io_error("chown", path))
}

#[cfg(test)]
mod tests {
    use std::{
        os::unix::fs::{PermissionsExt, symlink},
        path::PathBuf,
    };

    use super::*;
    use crate::{ClusterOptions, Listen, LocalCluster, find_binaries, running_as_root};

    /// A directory for one test, removed when dropped.
    struct ScratchDirectory(PathBuf);

    impl Drop for ScratchDirectory {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// The uid and gid of `nobody`, another user than this one (tests as root only).
    fn nobody() -> (u32, u32) {
        let name = std::ffi::CString::new("nobody").unwrap();
        // SAFETY: getpwnam reads a NUL-terminated name; the entry is read at once and
        // not kept.
        let entry = unsafe { libc::getpwnam(name.as_ptr()) };
        assert!(!entry.is_null(), "no user nobody");
        // SAFETY: checked not null just above.
        unsafe { ((*entry).pw_uid, (*entry).pw_gid) }
    }

    fn scratch() -> ScratchDirectory {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let path = std::env::temp_dir().join(format!(
            "outbox-local-postgres-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir(&path).unwrap();
        ScratchDirectory(path)
    }

    fn chmod(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn start(directory: &Path) -> Result<LocalCluster, ClusterError> {
        LocalCluster::start(
            directory,
            Some(&find_binaries().expect("PostgreSQL's server binaries are installed")),
            ClusterOptions {
                listen: Listen::UnixSocket,
                durable: false,
            },
        )
    }

    fn refusal(directory: &Path) -> String {
        match start(directory) {
            Ok(cluster) => {
                let _ = cluster.stop_immediately();
                panic!("{} was taken", directory.display())
            }
            Err(error) => {
                assert!(
                    matches!(error, ClusterError::UnsafeDirectory { .. }),
                    "{error}"
                );
                error.to_string()
            }
        }
    }

    #[test]
    fn a_directory_everyone_can_write_without_the_sticky_bit_is_refused() {
        let scratch = scratch();
        let data = scratch.0.join("data");
        std::fs::create_dir(&data).unwrap();
        chmod(&data, 0o777);
        let message = refusal(&data);
        assert!(
            message.contains("can be written by every user (mode 777)"),
            "{message}"
        );
        assert!(message.contains("--data-dir"), "{message}");
        assert!(!data.join("postgres.lock").exists(), "the lock was written");
        assert!(!data.join("postgres").exists(), "a cluster was made");
    }

    #[test]
    fn a_directory_below_one_everyone_can_write_is_refused() {
        let scratch = scratch();
        chmod(&scratch.0, 0o777);
        let data = scratch.0.join("data");
        let message = refusal(&data);
        assert!(
            message.contains(&format!("{} can be written", scratch.0.display())),
            "{message}"
        );
    }

    #[test]
    fn a_lock_file_that_is_a_symbolic_link_is_not_followed() {
        let scratch = scratch();
        let target = scratch.0.join("precious");
        std::fs::write(&target, "keep me").unwrap();
        let data = scratch.0.join("data");
        std::fs::create_dir(&data).unwrap();
        symlink(&target, data.join("postgres.lock")).unwrap();
        let message = refusal(&data);
        assert!(
            message.contains("postgres.lock is a symbolic link"),
            "{message}"
        );
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
    }

    #[test]
    fn a_directory_of_another_user_is_refused() {
        if !running_as_root() {
            eprintln!("skipped: only root can make a directory of another user");
            return;
        }
        let (uid, gid) = nobody();
        let scratch = scratch();
        let data = scratch.0.join("data");
        std::fs::create_dir(&data).unwrap();
        chmod(&data, 0o700);
        std::os::unix::fs::chown(&data, Some(uid), Some(gid)).unwrap();
        let message = refusal(&data);
        assert!(
            message.contains(&format!("belongs to uid {uid}, neither this user nor root")),
            "{message}"
        );
        assert!(!data.join("postgres.lock").exists(), "the lock was written");
    }

    /// As root, in a sticky directory everyone can write (as `/tmp`): another user's
    /// `postgres` link to a root-owned directory.
    #[test]
    fn a_cluster_directory_another_user_linked_is_not_handed_to_postgres() {
        if !running_as_root() {
            eprintln!("skipped: only root hands the cluster's directory to postgres");
            return;
        }
        let (uid, gid) = nobody();
        let scratch = scratch();
        let target = scratch.0.join("root-only");
        std::fs::create_dir(&target).unwrap();
        let data = scratch.0.join("data");
        std::fs::create_dir(&data).unwrap();
        chmod(&data, 0o1777);
        let link = data.join("postgres");
        symlink(&target, &link).unwrap();
        std::os::unix::fs::lchown(&link, Some(uid), Some(gid)).unwrap();
        let message = refusal(&data);
        assert!(
            message.contains(&format!("postgres belongs to uid {uid}")),
            "{message}"
        );
        let owner = std::fs::metadata(&target).unwrap().uid();
        assert_eq!(owner, 0, "the linked directory was handed over");
    }

    /// As root, a `postgres` link root made itself is still not followed to hand its
    /// target over: the cluster is made in a real directory only.
    #[test]
    fn a_cluster_directory_that_is_a_link_is_never_chowned_through() {
        if !running_as_root() {
            eprintln!("skipped: only root hands the cluster's directory to postgres");
            return;
        }
        let scratch = scratch();
        let target = scratch.0.join("root-only");
        std::fs::create_dir(&target).unwrap();
        let data = scratch.0.join("data");
        std::fs::create_dir(&data).unwrap();
        symlink(&target, data.join("postgres")).unwrap();
        let message = refusal(&data);
        assert!(message.contains("postgres is a symbolic link"), "{message}");
        let owner = std::fs::metadata(&target).unwrap().uid();
        assert_eq!(owner, 0, "the linked directory was handed over");
    }
}
