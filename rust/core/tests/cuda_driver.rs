//! The CUDA backends over the driver stand-in (`tests/devices/driver/cuda_standin.c`): what the shared
//! conformance suite cannot see — device discovery and its errors, out-of-memory, the calling
//! thread's context, releases queued off the workspace lock, and stream-ordered release events.
//! The stand-in logs the driver calls, so the tests check their order.
#![cfg(feature = "cuda")]

mod common;

use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::standin::exclusive;
use rustws_core::cuda::{device_count, failed_context_restores, probe, CudaMemory, DeferredRelease, PinnedHostMemory};
use rustws_core::{
    Backend, BackendError, Cause, Error, LearningPolicy, SpillPolicy, Workspace, WorkspaceConfiguration,
};

fn config(initial: u64) -> WorkspaceConfiguration {
    WorkspaceConfiguration {
        initial_size: initial,
        policy_learning: LearningPolicy::None,
        policy_spill: SpillPolicy::External,
        ..Default::default()
    }
}

/// Position of the first log line containing `needle` at or after `from`.
fn find(log: &str, needle: &str, from: usize) -> Option<usize> {
    log.lines().enumerate().skip(from).find(|(_, l)| l.contains(needle)).map(|(i, _)| i)
}

#[test]
fn devices_are_counted_and_a_bad_ordinal_or_no_device_is_an_error_naming_it() {
    let (_g, s) = exclusive();
    assert_eq!(device_count().unwrap(), 1);
    probe(0).unwrap();
    let bad = CudaMemory::new(3).unwrap_err();
    assert!(matches!(&bad, Error::Unavailable { what, .. } if what.contains("bad device ordinal 3")), "{bad:?}");
    // SAFETY: a switch of the stand-in.
    unsafe { (s.set_device_count)(0) };
    let none = PinnedHostMemory::new(0).unwrap_err().to_string();
    assert!(none.contains("sees no device"), "{none}");
    // SAFETY: as above.
    unsafe { (s.set_device_count)(2) };
    assert_eq!(CudaMemory::new(1).unwrap().ordinal(), 1);
}

#[test]
fn device_memory_out_of_memory_is_an_error_with_the_request() {
    let (_g, s) = exclusive();
    // SAFETY: a switch of the stand-in.
    unsafe { (s.set_memory_limit)(4 << 20) };
    let gpu: Arc<dyn Backend> = Arc::new(CudaMemory::new(0).unwrap());
    let mut w = Workspace::with_backend("OOM", config(1 << 20), gpu).unwrap();
    w.enter().unwrap();
    let fits = w.alloc(2 << 20).unwrap();
    let err = w.alloc(3 << 20).unwrap_err();
    assert!(
        matches!(
            err,
            Error::SystemOutOfMemory { cause: BackendError { cause: Cause::Driver { code: 2, .. }, .. }, .. }
        ),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.contains("CUDA_ERROR_OUT_OF_MEMORY") && text.contains("3145728"), "{text}");
    assert!(s.log().contains("OUT_OF_MEMORY"));
    // SAFETY: live, freed once.
    unsafe { w.free(fits) };
    w.exit().unwrap();
}

#[test]
fn every_call_restores_the_context_the_thread_had() {
    let (_g, s) = exclusive();
    let gpu = Arc::new(CudaMemory::new(0).unwrap());
    let b: Arc<dyn Backend> = gpu.clone();
    // SAFETY: stand-in calls: a context of "another library" becomes current on this thread.
    let foreign = unsafe { (s.foreign_context)() };
    // SAFETY: as above.
    assert_eq!(unsafe { (s.ctx_set_current)(foreign) }, 0);
    s.clear_log();
    let p = b.alloc_block(4096).unwrap();
    let host = [7u8; 4096];
    let mut back = [0u8; 4096];
    // SAFETY: `p` is a live block of 4096 bytes; the host buffers are 4096 bytes.
    unsafe {
        b.zero(p, 4096).unwrap();
        b.copy_from_host(p, NonNull::new(host.as_ptr() as *mut u8).unwrap(), 4096).unwrap();
        b.copy_to_host(NonNull::new(back.as_mut_ptr()).unwrap(), p, 4096).unwrap();
        b.free_block(p, 4096);
    }
    gpu.reclaim();
    assert_eq!(back, host);
    // SAFETY: a probe of the stand-in.
    assert_eq!(unsafe { (s.current_context)() }, foreign, "the foreign context was not restored");
    let log = s.log();
    assert!(log.contains("ctx=0"), "allocated in device 0's context:\n{log}");
    let set_ours = log.lines().filter(|l| *l == "cuCtxSetCurrent 0").count();
    let restore = log.lines().filter(|l| *l == "cuCtxSetCurrent -1").count();
    assert!(set_ours >= 5 && set_ours == restore, "each call switches and switches back:\n{log}");
    // SAFETY: unbinds the thread's context again.
    unsafe { (s.ctx_set_current)(std::ptr::null_mut()) };
}

#[test]
fn a_context_the_driver_will_not_make_current_is_an_error() {
    let (_g, s) = exclusive();
    let gpu = CudaMemory::new(0).unwrap();
    // SAFETY: a switch of the stand-in.
    unsafe { (s.set_failing_set_current)(1) };
    let err = gpu.alloc_block(1024).unwrap_err();
    assert_eq!(err.op, "cuCtxSetCurrent", "{err}");
    assert!(!s.log().contains("cuMemAlloc_v2"), "nothing was allocated in the wrong context");
    let p = gpu.alloc_block(1024).unwrap();
    // SAFETY: live, released once.
    unsafe { gpu.free_block(p, 1024) };
}

#[test]
fn releases_wait_in_a_queue_until_reclaimed_off_the_lock() {
    let (_g, s) = exclusive();
    let gpu = Arc::new(CudaMemory::new(0).unwrap());
    let w = Mutex::new(Workspace::with_backend("Q", config(1 << 20), gpu.clone()).unwrap());
    w.lock().unwrap().enter().unwrap();
    // SAFETY: a probe of the stand-in.
    let before = unsafe { (s.device_bytes)() };
    let big = w.lock().unwrap().alloc(4 << 20).unwrap(); // a spill: its own cuMemAlloc
                                                         // SAFETY: a probe of the stand-in.
    assert!(unsafe { (s.device_bytes)() } >= before + (4 << 20));
    // SAFETY: a switch of the stand-in: every driver free now takes 300 ms.
    unsafe { (s.set_free_delay_us)(300_000) };
    s.clear_log();
    let t = Instant::now();
    // SAFETY: live, freed once.
    unsafe { w.lock().unwrap().free(big) };
    assert!(!gpu.has_deferred(), "a freed spill is cached for the next one, not released");
    // Two cycles without a request of its class: the cache gives it back, at a cycle end under
    // the lock, which queues the release rather than waiting for the driver.
    for _ in 0..2 {
        let mut ws = w.lock().unwrap();
        ws.exit().unwrap();
        ws.enter().unwrap();
    }
    w.lock().unwrap().exit().unwrap();
    assert!(t.elapsed() < Duration::from_millis(150), "the workspace waited for the driver under the lock");
    assert!(gpu.has_deferred() && !s.log().contains("cuMemFree_v2"), "{}", s.log());
    std::thread::scope(|scope| {
        let reclaimer = scope.spawn(|| gpu.reclaim());
        std::thread::sleep(Duration::from_millis(50));
        // The driver is busy freeing; the workspace is not locked meanwhile.
        let t = Instant::now();
        let mut ws = w.lock().unwrap();
        let small = ws.alloc(1000).unwrap();
        // SAFETY: live, freed once.
        unsafe { ws.free(small) };
        drop(ws);
        assert!(t.elapsed() < Duration::from_millis(150), "the workspace waited for the driver's free");
        reclaimer.join().unwrap();
    });
    assert!(s.log().contains("cuMemFree_v2"), "{}", s.log());
    // SAFETY: a probe of the stand-in.
    assert_eq!(unsafe { (s.device_bytes)() }, before);
}

#[test]
fn a_refused_allocation_reclaims_the_queue_and_tries_again() {
    let (_g, s) = exclusive();
    // SAFETY: a switch of the stand-in.
    unsafe { (s.set_memory_limit)(3 << 20) };
    let gpu = CudaMemory::new(0).unwrap();
    let a = gpu.alloc_block(2 << 20).unwrap();
    // SAFETY: live, released once (queued).
    unsafe { gpu.free_block(a, 2 << 20) };
    s.clear_log();
    let b = gpu.alloc_block(2 << 20).unwrap();
    let log = s.log();
    let freed = find(&log, "cuMemFree_v2", 0).expect(&log);
    let allocated = find(&log, "cuMemAlloc_v2 0x", 0).expect(&log);
    assert!(freed < allocated, "the queued release goes first:\n{log}");
    // SAFETY: live, released once.
    unsafe { gpu.free_block(b, 2 << 20) };
}

#[test]
fn a_failing_driver_free_is_counted_not_fatal() {
    let (_g, s) = exclusive();
    let gpu = CudaMemory::new(0).unwrap();
    let pinned = PinnedHostMemory::new(0).unwrap();
    let a = gpu.alloc_block(4096).unwrap();
    let h = pinned.map(8192, false).unwrap();
    // SAFETY: fresh pinned memory is zero-filled by contract and host-accessible.
    assert!(unsafe { std::slice::from_raw_parts(h.as_ptr(), 8192) }.iter().all(|&x| x == 0));
    // SAFETY: live, released once each.
    unsafe {
        gpu.free_block(a, 4096);
        pinned.unmap(h, 8192);
    }
    // SAFETY: a switch of the stand-in.
    unsafe { (s.set_failing_frees)(1) };
    gpu.reclaim();
    pinned.reclaim();
    assert_eq!(gpu.failed_releases(), 1);
    assert_eq!(pinned.failed_releases(), 0);
    assert!(s.log().contains("cuMemFree_v2") && s.log().contains("FAILED") && s.log().contains("cuMemFreeHost"));
}

#[test]
fn release_events_follow_the_stream_and_order_before_waits_for_the_legacy_stream() {
    let (_g, s) = exclusive();
    let gpu = CudaMemory::new(0).unwrap();
    let mut stream = std::ptr::null_mut();
    // SAFETY: stand-in calls on the primary context of device 0, made current for them.
    unsafe {
        let mut ctx = std::ptr::null_mut();
        assert_eq!(cudarc::driver::sys::cuDevicePrimaryCtxRetain(&mut ctx, 0) as i32, 0);
        assert_eq!((s.ctx_set_current)(ctx.cast()), 0);
        assert_eq!((s.stream_create)(&mut stream, 1), 0);
        (s.set_events_pending)(1);
    }
    let ev = gpu.record_release(stream as usize).unwrap();
    assert!(!gpu.is_complete(&ev), "work on the stream is still running");
    // SAFETY: a switch of the stand-in.
    unsafe { (s.complete_events)() };
    assert!(gpu.is_complete(&ev));
    gpu.destroy_event(ev);
    let ev = gpu.record_release(stream as usize).unwrap();
    gpu.wait(&ev);
    assert!(gpu.is_complete(&ev));
    gpu.destroy_event(ev);
    s.clear_log();
    gpu.order_before(stream as usize).unwrap();
    let log = s.log();
    let rec = find(&log, "cuEventRecord", 0).expect(&log);
    assert!(log.lines().nth(rec).unwrap().ends_with(" 0x1"), "recorded on the legacy stream:\n{log}");
    let wait = find(&log, "cuStreamWaitEvent", rec).expect(&log);
    assert!(log.lines().nth(wait).unwrap().contains(&format!("{stream:p}")), "{log}");
    // SAFETY: unbinds the thread's context.
    unsafe { (s.ctx_set_current)(std::ptr::null_mut()) };
}

#[test]
fn a_context_the_driver_will_not_restore_is_counted() {
    let (_g, s) = exclusive();
    let gpu = CudaMemory::new(0).unwrap();
    // SAFETY: stand-in calls: a context of "another library" is current on this thread.
    let foreign = unsafe { (s.foreign_context)() };
    // SAFETY: as above.
    assert_eq!(unsafe { (s.ctx_set_current)(foreign) }, 0);
    let before = failed_context_restores();
    // SAFETY: a switch of the stand-in: ours is made current, then the restore fails.
    unsafe { (s.set_failing_set_current_after)(1, 1) };
    let p = gpu.alloc_block(4096).unwrap();
    assert_eq!(failed_context_restores(), before + 1);
    // SAFETY: a probe of the stand-in.
    assert_ne!(unsafe { (s.current_context)() }, foreign, "the switch left device 0's context current");
    // SAFETY: live, released once; then the thread's context is unbound.
    unsafe {
        gpu.free_block(p, 4096);
        (s.ctx_set_current)(std::ptr::null_mut());
    }
}

#[test]
fn device_blocks_of_their_own_take_exactly_their_bytes_and_every_block_is_256_aligned() {
    // The driver allocates at a granularity (2 MiB on current GPUs): a 2 MiB block that asked for
    // a header's or an alignment's bytes more would cost 4 MiB. Arena blocks carry the padding
    // that aligns them instead.
    let (_g, s) = exclusive();
    let gpu: Arc<dyn Backend> = Arc::new(CudaMemory::new(0).unwrap());
    assert_eq!(gpu.block_align(), 256);
    let mut w = Workspace::with_backend("EXACT", config(1 << 20), gpu).unwrap();
    w.enter().unwrap();
    s.clear_log();
    let own = w.alloc_aligned(2 << 20, 256).unwrap();
    let log = s.log();
    assert!(log.lines().any(|l| l.starts_with("cuMemAlloc_v2") && l.contains(" 2097152 ")), "{log}");
    assert_eq!(own.as_ptr() as usize % 256, 0);
    let mut small = Vec::new();
    for n in [1usize, 100, 255, 256, 4000, 70_000] {
        let raw = w.alloc_aligned(n, 256).unwrap();
        // SAFETY: live blocks of `w`.
        let info = unsafe { w.block_info(raw) };
        let (base, cap) = info.region.expect("small requests come from the arena");
        let data = (raw.as_ptr() as usize).next_multiple_of(256);
        assert!(data + n <= raw.as_ptr() as usize + info.requested && data + n <= base + cap);
        small.push(raw);
    }
    assert!(w.alloc_aligned(64, 100).is_err(), "an alignment that is no power of two is refused");
    for p in small.into_iter().chain([own]) {
        // SAFETY: live, freed once.
        unsafe { w.free(p) };
    }
    w.exit().unwrap();
    assert_eq!(w.stats().used_bytes + w.stats().external_bytes, 0);
}

/// A fill or copy the device refuses is an error, never a silent success: a zeroed request never
/// returns memory holding old bytes, and a realloc that cannot copy keeps the old block whole.
#[test]
fn a_refused_device_fill_or_copy_is_an_error_and_loses_nothing() {
    let (_g, s) = exclusive();
    let gpu = Arc::new(CudaMemory::new(0).unwrap());
    let b: Arc<dyn Backend> = gpu.clone();
    for n in 1..=3 {
        // SAFETY: a switch of the stand-in.
        unsafe { (s.set_failing_copies)(n) };
        assert!(b.alloc_block_zeroed(4096).is_err(), "a zeroed block whose fill failed was handed out");
        // SAFETY: a switch of the stand-in.
        unsafe { (s.set_failing_copies)(0) };
    }
    let p = b.alloc_block(4096).unwrap();
    let q = b.alloc_block(4096).unwrap();
    // SAFETY: a switch of the stand-in; `p` and `q` are live blocks of 4096 bytes.
    unsafe {
        (s.set_failing_copies)(1);
        assert!(b.zero(p, 4096).is_err());
        (s.set_failing_copies)(1);
        assert!(b.copy(q, p, 4096).is_err());
        b.free_block(p, 4096);
        b.free_block(q, 4096);
    }
    for zeroed_in_arena in [true, false] {
        let mut w = Workspace::with_backend("FILL", config(1 << 20), b.clone()).unwrap();
        w.enter().unwrap();
        // A block that dirties the arena, so that the next zeroed one must be cleared on the device.
        let dirty = w.alloc(8192).unwrap();
        // SAFETY: live, freed once.
        unsafe { w.free(dirty) };
        // SAFETY: a switch of the stand-in (enough failures for the arena and the fallback).
        unsafe { (s.set_failing_copies)(if zeroed_in_arena { 8 } else { 0 }) };
        if zeroed_in_arena {
            let err = w.alloc_zeroed(8192).unwrap_err();
            assert!(err.to_string().contains("LAUNCH_FAILED") || err.to_string().contains("clear"), "{err}");
            // SAFETY: a switch of the stand-in.
            unsafe { (s.set_failing_copies)(0) };
        }
        let old = w.alloc(1000).unwrap();
        let src: Vec<u8> = (0..1000).map(|i| i as u8).collect();
        // SAFETY: `old` is a live block of 1000 bytes; `src` is ours.
        unsafe { b.copy_from_host(old, NonNull::new(src.as_ptr() as *mut u8).unwrap(), 1000).unwrap() };
        // SAFETY: a switch of the stand-in; `old` is live.
        unsafe { (s.set_failing_copies)(1) };
        // SAFETY: `old` is live.
        let err = unsafe { w.realloc(old, 1 << 20) }.unwrap_err();
        assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
        let mut back = vec![0u8; 1000];
        // SAFETY: `old` is still live (the failed realloc kept it); `back` is ours.
        unsafe { b.copy_to_host(NonNull::new(back.as_mut_ptr()).unwrap(), old, 1000).unwrap() };
        assert_eq!(back, src, "a failed realloc lost the data");
        // SAFETY: live, freed once.
        unsafe { w.free(old) };
        w.exit().unwrap();
        w.verify();
        assert_eq!(w.stats().used_bytes + w.stats().external_bytes, 0);
    }
}

/// Whether a consumer's stream is ordered by the legacy default stream is read while the stream
/// is valid; a destroyed stream is never named again.
#[test]
fn stream_flags_say_which_streams_the_legacy_stream_orders() {
    let (_g, s) = exclusive();
    let gpu = CudaMemory::new(0).unwrap();
    let (mut blocking, mut non_blocking) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: stand-in calls on the primary context of device 0, made current for them.
    unsafe {
        let mut ctx = std::ptr::null_mut();
        assert_eq!(cudarc::driver::sys::cuDevicePrimaryCtxRetain(&mut ctx, 0) as i32, 0);
        assert_eq!((s.ctx_set_current)(ctx.cast()), 0);
        assert_eq!((s.stream_create)(&mut blocking, 0), 0);
        assert_eq!((s.stream_create)(&mut non_blocking, 1), 0);
    }
    assert!(gpu.synchronizes_with_legacy(1).unwrap());
    assert!(gpu.synchronizes_with_legacy(2).unwrap());
    assert!(gpu.synchronizes_with_legacy(blocking as usize).unwrap());
    assert!(!gpu.synchronizes_with_legacy(non_blocking as usize).unwrap());
    s.clear_log();
    gpu.synchronize().unwrap();
    assert!(s.log().contains("cuCtxSynchronize"), "{}", s.log());
    // SAFETY: stand-in calls: both streams are ours; then the thread's context is unbound.
    unsafe {
        (s.stream_destroy)(blocking);
        (s.stream_destroy)(non_blocking);
        (s.ctx_set_current)(std::ptr::null_mut());
    }
}
