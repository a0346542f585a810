# Install the daemon and the mount(8) helpers where mount(8) finds them,
# and the project's test and lint entry points.
PREFIX ?= /usr/local
SBIN ?= /sbin
SYSTEMD_UNIT_DIR ?= /etc/systemd/system
CARGO ?= cargo

.PHONY: install uninstall test test-deps lint bench
install:
	$(CARGO) install --locked --path fs --root $(PREFIX)
	$(CARGO) install --locked --path mount-helper --root $(PREFIX)
	ln -sf $(PREFIX)/bin/mount-converged $(SBIN)/mount.converged
	ln -sf $(PREFIX)/bin/mount-converged $(SBIN)/mount.fuse.converged
	mkdir -p $(SYSTEMD_UNIT_DIR)
	sed 's#/usr/local/bin/converged#$(PREFIX)/bin/converged#' dist/systemd/converged@.service > $(SYSTEMD_UNIT_DIR)/converged@.service

uninstall:
	rm -f $(SBIN)/mount.converged $(SBIN)/mount.fuse.converged $(SYSTEMD_UNIT_DIR)/converged@.service
	rm -f $(PREFIX)/bin/converged $(PREFIX)/bin/mount-converged

# Everything the tests need besides cargo: system packages (etcd for the real
# etcd cluster, protoc for etcd-client's build, fuse3; the verbs headers, libclang and
# pkg-config for rdma-sys, built by transport's `rdma` feature; attr for getfattr), numpy,
# moto (a real S3-compatible server for the object tier tests) with boto3 (an S3 client
# that is not converged's), pjdfstest and nextest.
# gdb: the stress test (tests/tests/stress.rs) dumps a hung daemon's threads with it.
# fio: the latency-histogram test's workload; openssl: the etcd TLS test's certificates;
# systemd: systemd-analyze, which verifies the shipped unit; python3: the automount test's autofs driver.
SYSTEM_PACKAGES = acl etcd-server protobuf-compiler libprotobuf-dev fuse3 util-linux libibverbs-dev librdmacm-dev clang libclang-dev pkg-config attr gdb fio openssl systemd python3
test-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi
	python3 -c "import numpy" 2>/dev/null || python3 -m pip install -q numpy
	command -v moto_server >/dev/null && python3 -c "import boto3" 2>/dev/null || python3 -m pip install -q 'moto[server]' boto3
	command -v azurite-blob >/dev/null || npm install -g --silent azurite@3.35.0
	python3 -c "import azure.storage.blob" 2>/dev/null || python3 -m pip install -q azure-storage-blob
	command -v cargo-nextest >/dev/null || $(CARGO) install cargo-nextest --locked
	command -v pjdfstest >/dev/null || $(CARGO) install pjdfstest --locked

# Unit, mount, crash, reference-model, mount(8) and pjdfstest tests. Needs root and /dev/fuse.
# Then the patched fuser's own unit tests (a crate outside the workspace, with
# its own lockfile): the ring slots' recovery decisions among them.
test: test-deps
	$(CARGO) build --workspace --all-targets
	$(CARGO) nextest run --workspace --no-fail-fast
	$(CARGO) test --locked --manifest-path third_party/fuser/Cargo.toml --target-dir target/fuser --lib

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

bench:
	bench/single-node.sh
