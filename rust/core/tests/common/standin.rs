//! The CUDA driver stand-in (`tests/devices/driver/cuda_standin.c` at the repository root): compiled here
//! with the machine's C compiler and loaded before cudarc looks for a driver, so that the real
//! `CudaMemory` and `PinnedHostMemory` backends run over host memory. The library's SONAME is
//! `libcuda.so`, the first name cudarc tries, so its lookup finds the copy already loaded.

use std::ffi::{c_char, c_int, c_long, c_void, CString};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The stand-in's switches and probes (see the C file).
pub struct Standin {
    pub reset: unsafe extern "C" fn(),
    pub set_device_count: unsafe extern "C" fn(c_int),
    pub set_memory_limit: unsafe extern "C" fn(usize),
    pub set_failing_frees: unsafe extern "C" fn(c_int),
    pub set_free_delay_us: unsafe extern "C" fn(c_long),
    pub set_failing_set_current: unsafe extern "C" fn(c_int),
    pub set_failing_set_current_after: unsafe extern "C" fn(c_int, c_int),
    pub set_events_pending: unsafe extern "C" fn(c_int),
    pub set_failing_copies: unsafe extern "C" fn(c_int),
    pub complete_events: unsafe extern "C" fn(),
    pub device_bytes: unsafe extern "C" fn() -> usize,
    pub host_bytes: unsafe extern "C" fn() -> usize,
    pub foreign_context: unsafe extern "C" fn() -> *mut c_void,
    pub current_context: unsafe extern "C" fn() -> *mut c_void,
    pub ctx_set_current: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub stream_create: unsafe extern "C" fn(*mut *mut c_void, u32) -> c_int,
    pub stream_destroy: unsafe extern "C" fn(*mut c_void) -> c_int,
    log: unsafe extern "C" fn(*mut c_char, usize) -> usize,
    clear_log: unsafe extern "C" fn(),
}

impl Standin {
    /// The calls logged since the last `clear_log`, one a line.
    pub fn log(&self) -> String {
        // SAFETY: the C function writes at most `cap` bytes, NUL-terminated.
        unsafe {
            let n = (self.log)(std::ptr::null_mut(), 0);
            let mut buf = vec![0u8; n + 1];
            (self.log)(buf.as_mut_ptr().cast(), buf.len());
            buf.truncate(n);
            String::from_utf8_lossy(&buf).into_owned()
        }
    }

    pub fn clear_log(&self) {
        // SAFETY: no arguments, no preconditions.
        unsafe { (self.clear_log)() }
    }
}

fn source() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/devices/driver/cuda_standin.c")
}

/// Compiles (once per test binary) and loads the stand-in; panics with the compiler's output
/// when it cannot.
pub fn load() -> &'static Standin {
    static LOADED: OnceLock<Standin> = OnceLock::new();
    LOADED.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("cuda-standin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("cannot create the stand-in's folder");
        let lib = dir.join("libcuda.so");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
        let out = Command::new(&cc)
            .args(["-shared", "-fPIC", "-O1", "-fvisibility=hidden", "-Wl,-soname,libcuda.so", "-o"])
            .arg(&lib)
            .arg(source())
            .arg("-lpthread")
            .output()
            .unwrap_or_else(|e| panic!("cannot run the C compiler {cc:?}: {e}"));
        assert!(out.status.success(), "the stand-in did not compile:\n{}", String::from_utf8_lossy(&out.stderr));
        let path = CString::new(lib.to_str().unwrap()).unwrap();
        // SAFETY: loads a library we just built; its initialisers have no side effects.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        assert!(!handle.is_null(), "cannot load the stand-in from {}", lib.display());
        /// The symbol `name` of the stand-in as a function pointer of type `F`.
        ///
        /// # Safety
        /// `F` must be the function pointer type of the C function `name`.
        unsafe fn sym<F: Copy>(handle: *mut c_void, name: &str) -> F {
            let c = CString::new(name).unwrap();
            // SAFETY: `handle` is a live library handle (never closed).
            let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
            assert!(!p.is_null(), "the stand-in does not export {name}");
            assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
            // SAFETY: the caller names a function pointer type for this symbol.
            unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
        }
        // SAFETY: each symbol is the C function of that name with the signature declared above.
        unsafe {
            Standin {
                reset: sym(handle, "standin_reset"),
                set_device_count: sym(handle, "standin_set_device_count"),
                set_memory_limit: sym(handle, "standin_set_memory_limit"),
                set_failing_frees: sym(handle, "standin_set_failing_frees"),
                set_free_delay_us: sym(handle, "standin_set_free_delay_us"),
                set_failing_set_current: sym(handle, "standin_set_failing_set_current"),
                set_failing_set_current_after: sym(handle, "standin_set_failing_set_current_after"),
                set_events_pending: sym(handle, "standin_set_events_pending"),
                set_failing_copies: sym(handle, "standin_set_failing_copies"),
                complete_events: sym(handle, "standin_complete_events"),
                device_bytes: sym(handle, "standin_device_bytes"),
                host_bytes: sym(handle, "standin_host_bytes"),
                foreign_context: sym(handle, "standin_foreign_context"),
                current_context: sym(handle, "standin_current_context"),
                ctx_set_current: sym(handle, "cuCtxSetCurrent"),
                stream_create: sym(handle, "cuStreamCreate"),
                stream_destroy: sym(handle, "cuStreamDestroy_v2"),
                log: sym(handle, "standin_log"),
                clear_log: sym(handle, "standin_clear_log"),
            }
        }
    })
}

/// Serialises the tests that flip the stand-in's switches (they share one driver), and resets
/// the switches for the holder.
pub fn exclusive() -> (MutexGuard<'static, ()>, &'static Standin) {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let s = load();
    // SAFETY: no arguments, no preconditions.
    unsafe { (s.reset)() };
    (guard, s)
}
