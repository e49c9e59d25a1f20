//! Simulator (filled next).
