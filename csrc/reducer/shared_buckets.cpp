// Bucket buffers in shared memory when the gradients are reduced over pycomm's
// shared-memory backend (See Note [Symmetric buffers] in shm/symmetric.h).
#include <c10/util/Exception.h>

#include "reducer/reducer.h"
#include "shm/backend.h"

namespace pycomm::reducer {

BufferFactory Reducer::bucket_factory() {
  buckets_shared_ = false;
  if (!options_.shared_buckets) return {};
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = pg_->getBackend(c10::DeviceType::CPU);
  } catch (const c10::Error&) {
    return {};  // no CPU backend (a GPU-only group): nothing to share
  }
  auto* shm = dynamic_cast<shm::ShmBackend*>(backend.get());
  if (shm == nullptr) return {};
  // Python warns with shared_buckets_why() (TorchReducer in pycomm/ddp/compat.py).
  return [this, backend](const std::vector<int64_t>& numels,
                         const std::vector<at::ScalarType>& dtypes) {
    std::string why;
    auto buffers =
        static_cast<shm::ShmBackend*>(backend.get())->symmetric_buffers(numels, dtypes, why);
    shared_buckets_why_ = why;
    buckets_shared_ = !buffers.empty();
    return buffers;
  };
}

}  // namespace pycomm::reducer
