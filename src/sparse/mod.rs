//! Jagged (variable-length) data: `JaggedTensor`, `KeyedJaggedTensor`, `KeyedTensor` and the jagged op set (in progress).
