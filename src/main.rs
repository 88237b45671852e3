//! The `ax` binary: the command line of `ax_cli` ([`ax_cli::main_with`]), with mimalloc.

/// mimalloc instead of glibc's allocator (docs/PERFORMANCE.md, W4: under a burst of
/// submits glibc spent a third of the server's CPU in `malloc_consolidate` and friends).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(ax_cli::main_with(std::env::args_os()))
}
