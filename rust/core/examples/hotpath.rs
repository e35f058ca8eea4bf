//! A tight alloc/free loop over one workspace, for instruction-level profiling of the hot path
//! (`valgrind --tool=callgrind target/release/examples/hotpath`).

use std::hint::black_box;

use rustws_core::{LearningPolicy, Workspace, WorkspaceConfiguration};

fn main() {
    let config =
        WorkspaceConfiguration { initial_size: 4 << 20, policy_learning: LearningPolicy::None, ..Default::default() };
    let mut ws = Workspace::new("hotpath", config).expect("workspace");
    let mut ptrs = Vec::with_capacity(1000);
    for _ in 0..200 {
        ws.enter().unwrap();
        for i in 0..1000 {
            ptrs.push(ws.alloc(black_box(64 + (i % 8) * 64)).unwrap());
        }
        for p in ptrs.drain(..) {
            // SAFETY: live, freed once.
            unsafe { ws.free(p) };
        }
        ws.exit().unwrap();
    }
    println!("{:?}", ws.stats());
}
