//! Aggregate allocation throughput of 1 and 2 threads, each in its own workspace, measured
//! outside any harness: `cargo run --release --example scaling`.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;

use rustws_core::{LearningPolicy, Workspace, WorkspaceConfiguration};

fn run(threads: usize, cycles: usize) -> f64 {
    let barrier = Barrier::new(threads);
    let secs = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = &barrier;
                s.spawn(move || {
                    let config = WorkspaceConfiguration {
                        initial_size: 4 << 20,
                        policy_learning: LearningPolicy::None,
                        ..Default::default()
                    };
                    let mut ws = Workspace::new("scaling", config).unwrap();
                    let mut ptrs = Vec::with_capacity(1000);
                    barrier.wait();
                    let t = Instant::now();
                    for _ in 0..cycles {
                        ws.enter().unwrap();
                        for i in 0..1000 {
                            ptrs.push(ws.alloc(black_box(64 + (i % 64) * 64)).unwrap());
                        }
                        for p in ptrs.drain(..) {
                            // SAFETY: live, freed once.
                            unsafe { ws.free(p) };
                        }
                        ws.exit().unwrap();
                    }
                    t.elapsed().as_secs_f64()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).fold(0.0, f64::max)
    });
    (threads * cycles * 1000) as f64 / secs
}

fn main() {
    let mut ratios = Vec::new();
    for _ in 0..7 {
        let one = run(1, 20_000);
        let two = run(2, 20_000);
        ratios.push(two / one);
        println!("1 thread {:.1} M/s, 2 threads {:.1} M/s aggregate, ratio {:.2}", one / 1e6, two / 1e6, two / one);
    }
    ratios.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!("median ratio {:.2}", ratios[ratios.len() / 2]);
}
