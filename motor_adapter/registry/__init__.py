"""Where registrations outlive the process: the store protocol, file and etcd stores, write-through."""
