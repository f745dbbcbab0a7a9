//! The command line of every example, read one way: `-h` / `--help` prints the usage to
//! stdout and exits with 0; a bad argument (unknown, missing its value, out of range, not
//! UTF-8) is named on stderr, with the usage, and exits with 2, before the example does
//! anything. A run that fails later exits with 1: that is the example's own part.

// Each example includes this file and uses only what it needs.
#![allow(dead_code)]

use std::fmt::Display;

/// An example's arguments, read flag by flag.
pub struct Cli {
    usage: &'static str,
    args: std::iter::Skip<std::env::ArgsOs>,
}

impl Cli {
    /// The arguments after the program's name; `usage` is what `--help` prints.
    pub fn new(usage: &'static str) -> Cli {
        Cli {
            usage,
            args: std::env::args_os().skip(1),
        }
    }

    /// The next argument as text, or `None` at the end; one that is not UTF-8 is refused.
    fn next(&mut self) -> Option<String> {
        let arg = self.args.next()?;
        Some(
            arg.into_string()
                .unwrap_or_else(|arg| self.refuse(format_args!("{arg:?} is not UTF-8"))),
        )
    }

    /// The next flag, or `None` at the end: `-h` / `--help` prints the usage and exits with
    /// 0.
    pub fn next_flag(&mut self) -> Option<String> {
        let flag = self.next()?;
        if flag == "-h" || flag == "--help" {
            println!("{}", self.usage);
            std::process::exit(0);
        }
        Some(flag)
    }

    /// The value after `flag`; refused when there is none.
    pub fn value(&mut self, flag: &str) -> String {
        self.next()
            .unwrap_or_else(|| self.refuse(format_args!("{flag} needs a value")))
    }

    /// The value after `flag`, read by `parse`, whose error says what to give instead.
    pub fn parsed<T>(&mut self, flag: &str, parse: impl FnOnce(&str) -> Result<T, String>) -> T {
        let value = self.value(flag);
        parse(&value).unwrap_or_else(|e| self.refuse(e))
    }

    /// Refuses `flag`, which is none of this example's.
    pub fn unknown(&self, flag: &str) -> ! {
        self.refuse(format_args!("unknown argument {flag:?}"))
    }

    /// Refuses the command line: `error: {why}` and the usage on stderr, exit code 2.
    pub fn refuse(&self, why: impl Display) -> ! {
        eprintln!("error: {why}\n{}", self.usage);
        std::process::exit(2);
    }

    /// Refuses any argument left.
    pub fn finish(mut self) {
        if let Some(flag) = self.next_flag() {
            self.unknown(&flag);
        }
    }
}

/// The command line of an example that takes no arguments: `--help` says so, anything
/// else is refused.
pub fn no_arguments(usage: &'static str) {
    Cli::new(usage).finish();
}
