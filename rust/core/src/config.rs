//! Workspace configuration: every policy of the contract, sizes with units, and the validation
//! that turns an invalid value or combination into an [`Error::InvalidConfig`] naming the field.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::error::Error;

/// The adaptive profile's `helper_min_size`: smaller requests are served by the allocator the
/// workspace would otherwise replace (NumPy's own, with its cache of small blocks), which is as
/// fast as any arena for them and takes no lock.
pub const ADAPTIVE_HELPER_MIN_SIZE: u64 = 1024;

/// The largest size any field may take: 2^48 bytes (256 TiB) is more than any mapping can hold.
pub const MAX_SIZE_BYTES: u64 = 1 << 48;

macro_rules! policy_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vmeta])* $variant),+ }

        impl $name {
            /// Every member, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The member's name as the Python enum spells it.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s.to_ascii_uppercase().as_str() {
                    $($text => Ok($name::$variant),)+
                    _ => Err(format!(
                        "{:?} is not a {}; expected one of {}",
                        s,
                        stringify!($name),
                        [$($text),+].join(", ")
                    )),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { f.write_str(self.as_str()) }
        }
    };
}

policy_enum!(
    /// How large the arena is made from the initial or learned size.
    AllocationPolicy {
        /// Exactly the initial or learned size.
        Strict = "STRICT",
        /// `overallocation_limit` × size on top.
        Overallocate = "OVERALLOCATE",
        /// No arena: every allocation is a fresh system allocation (debugging).
        Always = "ALWAYS",
    }
);

policy_enum!(
    /// How the workspace learns its size.
    LearningPolicy {
        /// Never learn; `initial_size` decides.
        None = "NONE",
        /// Learn the peak of the first cycle(s), size the arena once.
        FirstLoop = "FIRST_LOOP",
        /// Learn over `cycles_before_initialization` cycles and keep adapting when cycles grow.
        OverTime = "OVER_TIME",
        /// Learn from every cycle: the arena follows the largest need of the recent cycles
        /// (growing at a cycle end after spills, or within a cycle that churns through external
        /// memory, and shrinking once an outlier cycle has aged out), pre-faults only what
        /// cycles used, and serves huge requests as lazily faulted mappings of their own. The
        /// profile of `rustws.workspace(name)` without a configuration.
        Adaptive = "ADAPTIVE",
    }
);

policy_enum!(
    /// What happens to a request the arena cannot serve.
    SpillPolicy {
        /// Refuse it with [`Error::OutOfMemory`].
        Fail = "FAIL",
        /// Serve it outside the arena now, grow the arena at the end of the cycle.
        Reallocate = "REALLOCATE",
        /// Serve it outside the arena, never grow.
        External = "EXTERNAL",
    }
);

policy_enum!(
    /// What happens to the arena at the end of a cycle.
    ResetPolicy {
        /// Rewind at every cycle end (blocks still referenced stay pinned).
        BlockLeft = "BLOCK_LEFT",
        /// Circular: allocation continues across cycles and wraps at the end.
        EndOfBufferReached = "ENDOFBUFFER_REACHED",
    }
);

policy_enum!(
    /// Host mirroring of device workspaces.
    MirroringPolicy {
        /// A host mirror in pinned memory.
        Full = "FULL",
        /// Device memory only.
        Disabled = "DISABLED",
        /// Host memory only.
        HostOnly = "HOST_ONLY",
    }
);

policy_enum!(
    /// Where the arena's memory comes from.
    LocationPolicy {
        /// Anonymous memory.
        Ram = "RAM",
        /// A memory-mapped file at `temp_file_path`.
        Mmap = "MMAP",
    }
);

policy_enum!(
    /// Debugging switches.
    DebugMode {
        /// Normal operation.
        Disabled = "DISABLED",
        /// Every allocation is served outside the arena and counted as a spill.
        SpillEverything = "SPILL_EVERYTHING",
        /// Workspaces are off: allocations are plain system allocations.
        BypassEverything = "BYPASS_EVERYTHING",
    }
);

impl DebugMode {
    /// The override from `RUSTWS_DEBUG_MODE` (`bypass` or `spill`), if set to a known value.
    pub fn from_env() -> Option<DebugMode> {
        DebugMode::env_override().ok().flatten()
    }

    /// The override from `RUSTWS_DEBUG_MODE`: None when unset, an error naming the variable when
    /// it holds no debug mode (a typo must not silently leave workspaces on).
    pub fn env_override() -> Result<Option<DebugMode>, Error> {
        match std::env::var("RUSTWS_DEBUG_MODE") {
            Ok(v) => DebugMode::parse_env(&v).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => {
                Err(invalid("RUSTWS_DEBUG_MODE", format!("{v:?} is not text; expected bypass, spill or disabled")))
            }
        }
    }

    /// A value of `RUSTWS_DEBUG_MODE`: `bypass`, `spill`, `disabled` (or the mode's full name),
    /// in any case; empty means disabled.
    pub fn parse_env(value: &str) -> Result<DebugMode, Error> {
        match value.trim().to_ascii_lowercase().as_str() {
            "bypass" | "bypass_everything" => Ok(DebugMode::BypassEverything),
            "spill" | "spill_everything" => Ok(DebugMode::SpillEverything),
            "" | "disabled" | "off" | "none" => Ok(DebugMode::Disabled),
            _ => Err(invalid(
                "RUSTWS_DEBUG_MODE",
                format!("{value:?} is not a debug mode; expected bypass, spill or disabled"),
            )),
        }
    }
}

/// The most learning cycles `cycles_before_initialization` may ask for.
pub const MAX_CYCLES_BEFORE_INITIALIZATION: u64 = 1_000_000;

/// Every knob of a workspace. Build one with [`WorkspaceConfiguration::default`] and struct update
/// syntax, then call [`WorkspaceConfiguration::validate`].
#[derive(Debug, Clone, PartialEq)]
pub struct WorkspaceConfiguration {
    pub initial_size: u64,
    pub min_size: u64,
    pub max_size: u64,
    pub overallocation_limit: f64,
    pub cycles_before_initialization: u64,
    pub policy_allocation: AllocationPolicy,
    pub policy_learning: LearningPolicy,
    pub policy_spill: SpillPolicy,
    pub policy_reset: ResetPolicy,
    pub policy_mirroring: MirroringPolicy,
    pub policy_location: LocationPolicy,
    pub temp_file_path: Option<PathBuf>,
    pub temp_block_size: u64,
    pub helper_min_size: u64,
    pub helper_allow_fallback: bool,
    pub use_cycle_detector: bool,
    pub debug_mode: DebugMode,
}

impl Default for WorkspaceConfiguration {
    fn default() -> Self {
        WorkspaceConfiguration {
            initial_size: 0,
            min_size: 0,
            max_size: 0,
            overallocation_limit: 0.3,
            cycles_before_initialization: 0,
            policy_allocation: AllocationPolicy::Overallocate,
            policy_learning: LearningPolicy::FirstLoop,
            policy_spill: SpillPolicy::External,
            policy_reset: ResetPolicy::BlockLeft,
            policy_mirroring: MirroringPolicy::Full,
            policy_location: LocationPolicy::Ram,
            temp_file_path: None,
            temp_block_size: 0,
            helper_min_size: 0,
            helper_allow_fallback: true,
            use_cycle_detector: false,
            debug_mode: DebugMode::Disabled,
        }
    }
}

fn invalid(field: &'static str, message: String) -> Error {
    Error::InvalidConfig { field, message }
}

impl WorkspaceConfiguration {
    /// The fields' names, in declaration order: the one definition of the configuration's
    /// fields, which the bindings read dictionaries by and the Python dataclass follows.
    pub const FIELDS: [&'static str; 17] = [
        "initial_size",
        "min_size",
        "max_size",
        "overallocation_limit",
        "cycles_before_initialization",
        "policy_allocation",
        "policy_learning",
        "policy_spill",
        "policy_reset",
        "policy_mirroring",
        "policy_location",
        "temp_file_path",
        "temp_block_size",
        "helper_min_size",
        "helper_allow_fallback",
        "use_cycle_detector",
        "debug_mode",
    ];

    /// The adaptive profile: learning ADAPTIVE, spills REALLOCATE (they size the next cycle),
    /// every other field at its default.
    pub fn adaptive() -> Self {
        WorkspaceConfiguration {
            policy_learning: LearningPolicy::Adaptive,
            policy_spill: SpillPolicy::Reallocate,
            helper_min_size: ADAPTIVE_HELPER_MIN_SIZE,
            ..WorkspaceConfiguration::default()
        }
    }

    /// Checks every field and every combination; the error names the first offending field.
    pub fn validate(&self) -> Result<(), Error> {
        for (field, value) in [
            ("initial_size", self.initial_size),
            ("min_size", self.min_size),
            ("max_size", self.max_size),
            ("temp_block_size", self.temp_block_size),
            ("helper_min_size", self.helper_min_size),
        ] {
            if value > MAX_SIZE_BYTES {
                return Err(invalid(
                    field,
                    format!("{value} bytes exceeds the largest supported size ({MAX_SIZE_BYTES} bytes)"),
                ));
            }
        }
        if self.temp_block_size % crate::backend::BLOCK_ALIGN as u64 != 0 {
            let up = self.temp_block_size.next_multiple_of(crate::backend::BLOCK_ALIGN as u64);
            return Err(invalid(
                "temp_block_size",
                format!(
                    "must be a multiple of {} bytes (the block alignment), got {} (use {up})",
                    crate::backend::BLOCK_ALIGN,
                    self.temp_block_size
                ),
            ));
        }
        if !self.overallocation_limit.is_finite() || self.overallocation_limit < 0.0 {
            return Err(invalid(
                "overallocation_limit",
                format!("must be a finite number >= 0, got {}", self.overallocation_limit),
            ));
        }
        if self.overallocation_limit > 1000.0 {
            return Err(invalid(
                "overallocation_limit",
                format!("must be at most 1000, got {}", self.overallocation_limit),
            ));
        }
        if self.cycles_before_initialization > MAX_CYCLES_BEFORE_INITIALIZATION {
            return Err(invalid(
                "cycles_before_initialization",
                format!(
                    "must be at most {MAX_CYCLES_BEFORE_INITIALIZATION}, got {}",
                    self.cycles_before_initialization
                ),
            ));
        }
        if self.max_size > 0 && self.max_size < self.initial_size {
            return Err(invalid(
                "max_size",
                format!("max_size ({}) is smaller than initial_size ({})", self.max_size, self.initial_size),
            ));
        }
        if self.max_size > 0 && self.max_size < self.min_size {
            return Err(invalid(
                "max_size",
                format!("max_size ({}) is smaller than min_size ({})", self.max_size, self.min_size),
            ));
        }
        if self.policy_location == LocationPolicy::Mmap {
            if self.policy_learning != LearningPolicy::None {
                return Err(invalid(
                    "policy_learning",
                    format!(
                        "a memory-mapped workspace cannot learn its size: policy_learning must be NONE, got {}",
                        self.policy_learning
                    ),
                ));
            }
            if self.initial_size == 0 {
                return Err(invalid("initial_size", "a memory-mapped workspace needs initial_size > 0".to_string()));
            }
            if self.policy_allocation == AllocationPolicy::Always {
                return Err(invalid(
                    "policy_allocation",
                    "a memory-mapped workspace cannot use policy_allocation ALWAYS".to_string(),
                ));
            }
            match &self.temp_file_path {
                None => return Err(invalid("temp_file_path", "policy_location MMAP needs temp_file_path".to_string())),
                Some(p) => check_usable_path(p)?,
            }
        }
        Ok(())
    }

    /// The debug mode in force: `RUSTWS_DEBUG_MODE` overrides the configured one.
    pub fn effective_debug_mode(&self) -> DebugMode {
        DebugMode::from_env().unwrap_or(self.debug_mode)
    }
}

/// Whether `temp_file_path` can hold memory-mapped regions: a folder that can hold new files (a
/// file per region is made in it), or a path in such a folder naming nothing yet (created for a
/// region, removed with it) or a regular file (never written: regions get files beside it).
/// Devices, FIFOs, sockets, paths with a NUL byte, symlink loops and locations where no file can
/// be made (permission denied, a read-only file system) are refused here, naming the field,
/// rather than failing later as out-of-memory errors.
fn check_usable_path(p: &std::path::Path) -> Result<(), Error> {
    use std::os::unix::ffi::OsStrExt;
    let bad = |message: String| invalid("temp_file_path", message);
    if p.as_os_str().is_empty() {
        return Err(bad("is empty".to_string()));
    }
    if p.as_os_str().as_bytes().contains(&0) {
        return Err(bad(format!("{:?} contains a NUL byte", p.as_os_str())));
    }
    let parent_of = |p: &std::path::Path| match p.parent() {
        Some(parent) if parent.as_os_str().is_empty() => Ok(PathBuf::from(".")),
        Some(parent) => Ok(parent.to_path_buf()),
        None => Err(bad(format!("{} has no parent folder", p.display()))),
    };
    let dir = match std::fs::metadata(p) {
        Ok(m) if m.is_dir() => p.to_path_buf(),
        Ok(m) if m.is_file() => parent_of(p)?,
        Ok(_) => {
            return Err(bad(format!(
                "{} is not a regular file or a folder (a device, FIFO or socket cannot hold a mapping)",
                p.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => parent_of(p)?,
        Err(e) => return Err(bad(format!("{} is not usable: {e}", p.display()))),
    };
    let meta = std::fs::metadata(&dir).map_err(|e| bad(format!("folder {} is not usable: {e}", dir.display())))?;
    if !meta.is_dir() {
        return Err(bad(format!("{} is not a folder", dir.display())));
    }
    can_create_files_in(&dir).map_err(bad)
}

/// Whether a file can be made in `dir`: an unnamed `O_TMPFILE` file, which leaves nothing
/// behind (or, where the file system has none, a named one removed at once). Asking the file
/// system is the only exact answer: permission bits do not say what root may do, nor whether a
/// file system is mounted read-only or makes no files at all (`/proc`).
#[cfg(not(miri))]
fn can_create_files_in(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let refused = |e: std::io::Error| format!("no file can be created in folder {}: {e}", dir.display());
    match std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_TMPFILE).mode(0o600).open(dir) {
        Ok(_) => return Ok(()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::EINVAL)) => {}
        Err(e) => return Err(refused(e)),
    }
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = dir.join(format!(".rustws-probe-{}-{n}", std::process::id()));
    std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&probe).map_err(refused)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Under Miri, which makes no `O_TMPFILE` files: the folder's existence is all that is checked.
#[cfg(miri)]
fn can_create_files_in(_dir: &std::path::Path) -> Result<(), String> {
    Ok(())
}

/// Parses a size: a whole number of bytes, or a number with a unit (`"512KiB"`, `"64MiB"`, `"1GB"`,
/// `"1.5 GiB"`). Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB,
/// TiB, and the bare K, M, G, T) powers of 1024.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num = num.replace('_', "");
    let unit = unit.trim();
    if num.is_empty() {
        return Err(format!("{text:?} is not a size: expected a number of bytes, optionally with a unit"));
    }
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1000,
        "mb" => 1000_u64.pow(2),
        "gb" => 1000_u64.pow(3),
        "tb" => 1000_u64.pow(4),
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        _ => return Err(format!("{text:?} has an unknown unit {unit:?} (use B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)")),
    };
    let bytes = if num.contains('.') {
        let v: f64 = num.parse().map_err(|_| format!("{text:?} is not a size"))?;
        let b = v * mult as f64;
        if !b.is_finite() || b > MAX_SIZE_BYTES as f64 {
            return Err(format!("{text:?} exceeds the largest supported size ({MAX_SIZE_BYTES} bytes)"));
        }
        b.round() as u64
    } else {
        let v: u64 = num.parse().map_err(|_| format!("{text:?} is not a size"))?;
        v.checked_mul(mult)
            .filter(|b| *b <= MAX_SIZE_BYTES)
            .ok_or_else(|| format!("{text:?} exceeds the largest supported size ({MAX_SIZE_BYTES} bytes)"))?
    };
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `FIELDS` names the struct's fields in declaration order: checked against the derived
    /// `Debug`, which prints them so.
    #[test]
    fn fields_are_the_struct_fields_in_order() {
        let debug = format!("{:?}", WorkspaceConfiguration::default());
        let names: Vec<&str> = debug
            .trim_start_matches("WorkspaceConfiguration { ")
            .split(", ")
            .filter_map(|kv| kv.split_once(": ").map(|(k, _)| k))
            .filter(|k| k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .collect();
        assert_eq!(names, WorkspaceConfiguration::FIELDS);
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("512KiB").unwrap(), 512 * 1024);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
        assert_eq!(parse_size(" 1.5 GiB ").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("2k").unwrap(), 2048);
        assert!(parse_size("-1").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("3 parsecs").is_err());
        assert!(parse_size("1000000TiB").is_err());
    }

    #[test]
    fn defaults_are_valid() {
        WorkspaceConfiguration::default().validate().unwrap();
    }

    fn field_of(c: WorkspaceConfiguration) -> &'static str {
        match c.validate() {
            Err(Error::InvalidConfig { field, .. }) => field,
            other => panic!("expected an invalid configuration, got {other:?}"),
        }
    }

    #[test]
    fn invalid_values_name_their_field() {
        let d = WorkspaceConfiguration::default;
        assert_eq!(field_of(WorkspaceConfiguration { overallocation_limit: f64::NAN, ..d() }), "overallocation_limit");
        assert_eq!(field_of(WorkspaceConfiguration { overallocation_limit: -0.5, ..d() }), "overallocation_limit");
        assert_eq!(field_of(WorkspaceConfiguration { initial_size: 10, max_size: 5, ..d() }), "max_size");
        assert_eq!(field_of(WorkspaceConfiguration { min_size: 10, max_size: 5, ..d() }), "max_size");
        assert_eq!(field_of(WorkspaceConfiguration { initial_size: MAX_SIZE_BYTES + 1, ..d() }), "initial_size");
        let mmap = WorkspaceConfiguration {
            policy_location: LocationPolicy::Mmap,
            initial_size: 1 << 20,
            policy_learning: LearningPolicy::None,
            ..d()
        };
        assert_eq!(field_of(mmap.clone()), "temp_file_path");
        assert_eq!(
            field_of(WorkspaceConfiguration { policy_learning: LearningPolicy::FirstLoop, ..mmap.clone() }),
            "policy_learning"
        );
        assert_eq!(
            field_of(WorkspaceConfiguration { temp_file_path: Some("/nonexistent/dir/x".into()), ..mmap.clone() }),
            "temp_file_path"
        );
        let ok = WorkspaceConfiguration { temp_file_path: Some(std::env::temp_dir()), ..mmap };
        ok.validate().unwrap();
    }

    #[test]
    fn temp_block_size_is_a_multiple_of_the_block_alignment() {
        let d = WorkspaceConfiguration::default;
        for bad in [1, 63, 100, 1000, 4097] {
            assert_eq!(field_of(WorkspaceConfiguration { temp_block_size: bad, ..d() }), "temp_block_size");
        }
        for good in [0, 64, 4096, 1 << 20, 1_000_000] {
            WorkspaceConfiguration { temp_block_size: good, ..d() }.validate().unwrap();
        }
    }

    /// Every kind of path that cannot hold a mapping is refused when the configuration is
    /// validated, naming `temp_file_path`.
    #[test]
    #[cfg_attr(miri, ignore = "Miri makes no FIFOs or symlinks")]
    fn unusable_mmap_paths_name_temp_file_path() {
        let base = std::env::temp_dir().join(format!("rustws-paths-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let fifo = base.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let looped = base.join("loop");
        std::os::unix::fs::symlink(&looped, &looped).unwrap();
        let mmap = |p: PathBuf| WorkspaceConfiguration {
            policy_location: LocationPolicy::Mmap,
            initial_size: 1 << 20,
            policy_learning: LearningPolicy::None,
            temp_file_path: Some(p),
            ..WorkspaceConfiguration::default()
        };
        let nul = PathBuf::from(std::ffi::OsString::from(format!("{}/a\0b", base.display())));
        for p in [
            PathBuf::from("/dev/null"),
            nul,
            fifo,
            looped.clone(),
            looped.join("x"),
            PathBuf::from("/proc/rustws-arena.bin"),
            PathBuf::from("/proc"),
            base.join("missing/x"),
        ] {
            assert_eq!(field_of(mmap(p.clone())), "temp_file_path", "{}", p.display());
        }
        let existing = base.join("data.npy");
        std::fs::write(&existing, b"data").unwrap();
        for p in [base.clone(), base.join("new.bin"), existing] {
            mmap(p.clone()).validate().unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        }
        assert_eq!(std::fs::read_dir(&base).unwrap().count(), 3, "validation left files behind");
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn enums_round_trip_through_their_names() {
        for p in SpillPolicy::ALL {
            assert_eq!(p.as_str().parse::<SpillPolicy>().unwrap(), *p);
        }
        assert!("SIDEWAYS".parse::<ResetPolicy>().is_err());
    }
}
