//! The command line of an example that takes no arguments: `--help` says so, anything
//! else is refused, before the example does anything.

/// Stops the example when it was given an argument: `-h` / `--help` prints `usage` and
/// exits with 0; any other argument is refused, named, with exit code 2.
pub fn refuse_arguments(usage: &str) {
    let Some(arg) = std::env::args_os().nth(1) else {
        return;
    };
    if arg == "-h" || arg == "--help" {
        println!("{usage}");
        std::process::exit(0);
    }
    eprintln!("error: unknown argument {arg:?}\n{usage}");
    std::process::exit(2);
}
