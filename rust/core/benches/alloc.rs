//! Allocation + free in the core against bumpalo and the system allocator, on the same program:
//! 1000 allocations of sizes from 64 B to 4 MiB (log-uniform, fixed seed), all freed, then a cycle
//! reset. Also: one allocation and its free on a reuse hit (the block freed just before, of the
//! same class, handed out again), the cost of one allocation with 10 to 1,000,000 live (pinned)
//! blocks in the workspace, and aggregate throughput of 1 and 2 threads each allocating in its own
//! workspace. Throughput is reported per allocation (`Elements`). See `benches/README.md` for the
//! figures.

use std::alloc::{alloc, dealloc, Layout};
use std::hint::black_box;
use std::ptr::NonNull;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rustws_core::{LearningPolicy, Workspace, WorkspaceConfiguration};

const PER_CYCLE: usize = 1000;

/// Log-uniform sizes from 64 B to 4 MiB, from a fixed xorshift sequence.
fn sizes() -> Vec<usize> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..PER_CYCLE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let exp = 6.0 + (x % 10_000) as f64 / 10_000.0 * 16.0; // 2^6 .. 2^22
            (2f64.powf(exp) as usize).clamp(64, 4 << 20)
        })
        .collect()
}

fn workspace_for(sizes: &[usize]) -> Workspace {
    // Each block's slot (its class size and header), and room for the filler in front of a
    // block whose data starts on a page.
    let need: usize = sizes.iter().map(|&s| rustws_core::slot_for(s).expect("a class") + 4096).sum();
    let config = WorkspaceConfiguration {
        initial_size: need as u64,
        policy_learning: LearningPolicy::None,
        policy_allocation: rustws_core::AllocationPolicy::Strict,
        ..Default::default()
    };
    Workspace::new("bench", config).expect("workspace")
}

fn program(c: &mut Criterion) {
    let sizes = sizes();
    let mut g = c.benchmark_group("alloc_free_cycle");
    g.throughput(Throughput::Elements(PER_CYCLE as u64));
    g.measurement_time(Duration::from_secs(4));

    let mut ws = workspace_for(&sizes);
    let mut ptrs: Vec<NonNull<u8>> = Vec::with_capacity(PER_CYCLE);
    g.bench_function("rustws", |b| {
        b.iter(|| {
            ws.enter().unwrap();
            for &s in &sizes {
                ptrs.push(ws.alloc(black_box(s)).unwrap());
            }
            for p in ptrs.drain(..) {
                // SAFETY: each pointer is live and freed once.
                unsafe { ws.free(p) };
            }
            ws.exit().unwrap();
        })
    });
    assert_eq!(ws.stats().spill_count, 0, "the benchmark must measure the arena, not spills");

    let mut bump = bumpalo::Bump::new();
    g.bench_function("bumpalo", |b| {
        b.iter(|| {
            for &s in &sizes {
                black_box(bump.alloc_layout(Layout::from_size_align(black_box(s), 64).unwrap()));
            }
            bump.reset();
        })
    });

    let mut raw: Vec<(*mut u8, Layout)> = Vec::with_capacity(PER_CYCLE);
    g.bench_function("system", |b| {
        b.iter(|| {
            for &s in &sizes {
                let l = Layout::from_size_align(black_box(s), 64).unwrap();
                // SAFETY: non-zero size.
                let p = unsafe { alloc(l) };
                // Every allocator under test writes a header; the system allocator writes its own.
                raw.push((black_box(p), l));
            }
            for (p, l) in raw.drain(..) {
                // SAFETY: allocated just above with this layout.
                unsafe { dealloc(p, l) };
            }
        })
    });
    g.finish();
}

/// One allocation and its free where the block comes back from the free list of its class: a
/// temporary freed and the next one of its size, as a loop body makes them. The block kept live
/// beside it keeps the freed one off the hole's end (where the bump cursor would take it back).
fn reuse_hit(c: &mut Criterion) {
    let mut g = c.benchmark_group("reuse_hit");
    g.throughput(Throughput::Elements(PER_CYCLE as u64));
    g.measurement_time(Duration::from_secs(3));
    // The last: the same with the history recorded (two events per pair; no stacks, which the
    // binding adds).
    for (size, recorded) in [(256usize, false), (4096, false), (1 << 20, false), (4096, true)] {
        let config = WorkspaceConfiguration {
            initial_size: 64 << 20,
            policy_learning: LearningPolicy::None,
            ..Default::default()
        };
        let mut ws = Workspace::new("reuse", config).unwrap();
        if recorded {
            ws.record_history(Some(1 << 16)).unwrap();
        }
        ws.enter().unwrap();
        let first = ws.alloc(size).unwrap();
        let beside = ws.alloc(size).unwrap();
        // SAFETY: live, freed once: from here on `first`'s block is on its class's list.
        unsafe { ws.free(first) };
        let id = if recorded { format!("{size}-recorded") } else { size.to_string() };
        g.bench_with_input(BenchmarkId::from_parameter(id), &size, |b, &size| {
            b.iter(|| {
                for _ in 0..PER_CYCLE {
                    let p = ws.alloc(black_box(size)).unwrap();
                    // SAFETY: live, freed once.
                    unsafe { ws.free(black_box(p)) };
                }
            })
        });
        assert_eq!(ws.stats().spill_count, 0);
        // SAFETY: live, freed once.
        unsafe { ws.free(beside) };
        ws.exit().unwrap();
    }
    let mut bump = bumpalo::Bump::new();
    g.bench_function("bumpalo", |b| {
        b.iter(|| {
            for _ in 0..PER_CYCLE {
                black_box(bump.alloc_layout(Layout::from_size_align(black_box(256), 64).unwrap()));
            }
            bump.reset();
        })
    });
    g.finish();
}

/// One allocation + free with `live` blocks pinned in the same workspace.
fn live_blocks(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_with_live_blocks");
    g.throughput(Throughput::Elements(PER_CYCLE as u64));
    g.measurement_time(Duration::from_secs(3));
    for live in [10usize, 1_000, 100_000, 1_000_000] {
        let config = WorkspaceConfiguration {
            initial_size: (live as u64 + 2 * PER_CYCLE as u64) * 256,
            policy_learning: LearningPolicy::None,
            ..Default::default()
        };
        let mut ws = Workspace::new("live", config).unwrap();
        ws.enter().unwrap();
        let pinned: Vec<NonNull<u8>> = (0..live).map(|_| ws.alloc(64).unwrap()).collect();
        ws.exit().unwrap();
        let mut ptrs = Vec::with_capacity(PER_CYCLE);
        g.bench_with_input(BenchmarkId::from_parameter(live), &live, |b, _| {
            b.iter(|| {
                ws.enter().unwrap();
                for i in 0..PER_CYCLE {
                    ptrs.push(ws.alloc(black_box(64 + (i % 8) * 64)).unwrap());
                }
                for p in ptrs.drain(..) {
                    // SAFETY: live, freed once.
                    unsafe { ws.free(p) };
                }
                ws.exit().unwrap();
            })
        });
        assert_eq!(ws.stats().spill_count, 0);
        for p in pinned {
            // SAFETY: live, freed once.
            unsafe { ws.free(p) };
        }
    }
    g.finish();
}

/// Aggregate throughput of N threads, each with its own workspace.
fn threads(c: &mut Criterion) {
    let sizes: Vec<usize> = (0..PER_CYCLE).map(|i| 64 + (i % 64) * 64).collect();
    let mut g = c.benchmark_group("threads_own_workspace");
    g.measurement_time(Duration::from_secs(3));
    for n in [1usize, 2] {
        g.throughput(Throughput::Elements((n * PER_CYCLE) as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter_custom(|iters| {
                // Workspaces are made before the barrier; each thread times only its own loop,
                // and the slowest thread's time is the group's.
                let barrier = Barrier::new(n);
                std::thread::scope(|s| {
                    let handles: Vec<_> = (0..n)
                        .map(|_| {
                            let (sizes, barrier) = (&sizes, &barrier);
                            s.spawn(move || {
                                let mut ws = workspace_for(sizes);
                                let mut ptrs = Vec::with_capacity(PER_CYCLE);
                                barrier.wait();
                                let start = Instant::now();
                                for _ in 0..iters {
                                    ws.enter().unwrap();
                                    for &sz in sizes {
                                        ptrs.push(ws.alloc(black_box(sz)).unwrap());
                                    }
                                    for p in ptrs.drain(..) {
                                        // SAFETY: live, freed once.
                                        unsafe { ws.free(p) };
                                    }
                                    ws.exit().unwrap();
                                }
                                start.elapsed()
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).max().unwrap()
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, program, reuse_hit, live_blocks, threads);
criterion_main!(benches);
