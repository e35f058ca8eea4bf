//! A reuse-hit loop (a block freed and the next request of its class taking it back), for
//! instruction-level profiling (`valgrind --tool=callgrind target/release/examples/reuse`).

use std::hint::black_box;

use rustws_core::{LearningPolicy, Workspace, WorkspaceConfiguration};

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let config =
        WorkspaceConfiguration { initial_size: 4 << 20, policy_learning: LearningPolicy::None, ..Default::default() };
    let mut ws = Workspace::new("reuse", config).expect("workspace");
    ws.enter().unwrap();
    let first = ws.alloc(4096).unwrap();
    let beside = ws.alloc(4096).unwrap();
    // SAFETY: live, freed once.
    unsafe { ws.free(first) };
    for _ in 0..n {
        let p = ws.alloc(black_box(4096)).unwrap();
        // SAFETY: live, freed once.
        unsafe { ws.free(black_box(p)) };
    }
    // SAFETY: live, freed once.
    unsafe { ws.free(beside) };
    ws.exit().unwrap();
    println!("{:?}", ws.stats());
}
