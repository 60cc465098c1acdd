"""One Vulkan device through the `vulkan` (cffi) binding: instance, a compute queue, buffers,
pipelines from the shipped SPIR-V, one-shot and recorded command buffers.

Addresses. The backend registry's DeviceMemory speaks in integer device addresses; Vulkan has
buffers. Device memory is sub-allocated: pooled blocks of 256 MiB (one VkDeviceMemory and one
VkBuffer over it each; larger requests and host-visible buffers get their own), an allocation
handed out as the virtual address `(slot << SLOT_SHIFT) + offset in the block`, so
`resolve(addr)` gives the buffer and byte offset back in O(1). A kernel binds its buffer from the
aligned start at or below its tensor and indexes from there (maxStorageBufferRange bounds what
one binding reaches, not the block size).
"""
from __future__ import annotations

import bisect
import logging
import os
import threading
import time

import numpy as np

from ...errors import DeviceOutOfMemoryError, UnsupportedError

log = logging.getLogger("sdrt.vulkan")
SLOT_SHIFT = 40
OFFSET_MASK = (1 << SLOT_SHIFT) - 1
PUSH_BYTES = 128        # the minimum maxPushConstantsSize every driver gives
BINDINGS = 5            # storage buffers every pipeline's layout has (unused ones get a dummy)


def vk():
    import vulkan  # the optional binding: only imported once a Vulkan device is asked for
    return vulkan


def make_instance():
    v = vk()
    app = v.VkApplicationInfo(pApplicationName="sdrt", applicationVersion=1, pEngineName="sdrt",
                              engineVersion=1, apiVersion=v.VK_MAKE_VERSION(1, 1, 0))
    return v.vkCreateInstance(v.VkInstanceCreateInfo(pApplicationInfo=app), None)


def _features16(v, pd):
    f16 = v.VkPhysicalDevice16BitStorageFeatures()
    feats = v.VkPhysicalDeviceFeatures2(pNext=f16)
    v.vkGetPhysicalDeviceFeatures2(pd, feats)
    return bool(f16.storageBuffer16BitAccess)


def _compute_family(v, pd):
    for i, q in enumerate(v.vkGetPhysicalDeviceQueueFamilyProperties(pd)):
        if q.queueFlags & v.VK_QUEUE_COMPUTE_BIT:
            return i
    return None


def describe(v, pd) -> str:
    p = v.vkGetPhysicalDeviceProperties(pd)
    mem = v.vkGetPhysicalDeviceMemoryProperties(pd)
    local = [mem.memoryHeaps[i].size for i in range(mem.memoryHeapCount)
             if mem.memoryHeaps[i].flags & v.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT]
    size = max(local) if local else 0
    api = p.apiVersion
    kinds = {v.VK_PHYSICAL_DEVICE_TYPE_CPU: "CPU", v.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: "discrete GPU",
             v.VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: "integrated GPU", v.VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: "virtual GPU"}
    feats = ["fp16 storage"] + (["fp16 arithmetic"] if _float16_arith(v, pd) else [])
    name = p.deviceName if isinstance(p.deviceName, str) else v.ffi.string(p.deviceName).decode()
    return (f"{name} ({kinds.get(p.deviceType, 'device')}), {size / 2**30:.1f} GiB, "
            f"Vulkan {api >> 22}.{(api >> 12) & 0x3ff}.{api & 0xfff}, max binding "
            f"{p.limits.maxStorageBufferRange / 2**20:.0f} MiB, {', '.join(feats)}")


def _float16_arith(v, pd) -> bool:
    f = v.VkPhysicalDeviceShaderFloat16Int8Features()
    v.vkGetPhysicalDeviceFeatures2(pd, v.VkPhysicalDeviceFeatures2(pNext=f))
    return bool(f.shaderFloat16)


def usable_devices(instance) -> list:
    """Physical devices with a compute queue and 16-bit storage buffers (every shader needs it)."""
    v = vk()
    return [pd for pd in v.vkEnumeratePhysicalDevices(instance)
            if _compute_family(v, pd) is not None and _features16(v, pd)]


class _Buffer:
    """One VkDeviceMemory with one VkBuffer over all of it: a pooled block that allocations are
    carved from (`free` the sorted list of free (offset, size) runs), or a dedicated buffer
    (host-visible staging buffers; requests larger than half a block)."""
    __slots__ = ("buffer", "memory", "size", "mapped", "free", "used", "pooled")

    def __init__(self, buffer, memory, size, mapped=None, pooled=False):
        self.buffer, self.memory, self.size, self.mapped = buffer, memory, size, mapped
        self.pooled, self.used = pooled, 0
        self.free = [(0, size)] if pooled else []

    def take(self, n: int) -> int | None:
        """First fit: the offset of n free bytes (n a multiple of the alignment), or None."""
        for i, (off, size) in enumerate(self.free):
            if size >= n:
                if size == n:
                    del self.free[i]
                else:
                    self.free[i] = (off + n, size - n)
                self.used += n
                return off
        return None

    def give(self, off: int, n: int) -> None:
        """Return [off, off+n) to the free list, merged with its free neighbours."""
        self.used -= n
        i = bisect.bisect_left(self.free, (off, 0))
        if i < len(self.free) and off + n == self.free[i][0]:
            n += self.free.pop(i)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:
            off, n = self.free[i - 1][0], self.free[i - 1][1] + n
            i -= 1
            del self.free[i]
        self.free.insert(i, (off, n))


class VulkanDevice:
    """A logical device with one compute queue; also the backend's DeviceMemory (`memory`)."""

    def __init__(self, index: int):
        v = self.v = vk()
        self.instance = make_instance()
        pds = usable_devices(self.instance)
        if index >= len(pds):
            raise UnsupportedError(f"vulkan{index}: no such device ({len(pds)} usable)")
        self.pd = pds[index]
        self.name = f"vulkan{index}"
        self.props = v.vkGetPhysicalDeviceProperties(self.pd)
        self.limits = self.props.limits
        self.max_range = int(self.limits.maxStorageBufferRange)
        self.offset_align = max(16, int(self.limits.minStorageBufferOffsetAlignment))
        self.mem_props = v.vkGetPhysicalDeviceMemoryProperties(self.pd)
        self.family = _compute_family(v, self.pd)
        f16 = v.VkPhysicalDevice16BitStorageFeatures(storageBuffer16BitAccess=v.VK_TRUE)
        queue = v.VkDeviceQueueCreateInfo(queueFamilyIndex=self.family, queueCount=1, pQueuePriorities=[1.0])
        have = {e.extensionName for e in v.vkEnumerateDeviceExtensionProperties(self.pd, None)}
        # pipeline creation feedback: says whether each pipeline came from the pipeline cache
        self.feedback = v.VK_EXT_PIPELINE_CREATION_FEEDBACK_EXTENSION_NAME in have
        exts = [v.VK_EXT_PIPELINE_CREATION_FEEDBACK_EXTENSION_NAME] if self.feedback else []
        self.device = v.vkCreateDevice(self.pd, v.VkDeviceCreateInfo(
            pNext=f16, pQueueCreateInfos=[queue], queueCreateInfoCount=1,
            enabledExtensionCount=len(exts), ppEnabledExtensionNames=exts), None)
        self.queue = v.vkGetDeviceQueue(self.device, self.family, 0)
        self.pool = v.vkCreateCommandPool(self.device, v.VkCommandPoolCreateInfo(
            queueFamilyIndex=self.family, flags=v.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), None)
        self.fence = v.vkCreateFence(self.device, v.VkFenceCreateInfo(), None)
        self._slots: dict[int, _Buffer] = {}
        self._next = 1
        self._held = 0                      # bytes allocated from the driver (blocks + dedicated)
        self._pool: list[int] = []          # slots of the pooled blocks
        self._live: dict[int, int] = {}     # pooled allocation address -> bytes
        self._stage_ptr, self._stage_size = 0, 0
        self.alloc_align = max(256, int(self.limits.minStorageBufferOffsetAlignment))
        self.heap_bytes, self.block_bytes = self._heap_and_block()
        self._lock = threading.RLock()
        self._layouts()
        self._pipelines: dict = {}
        self._modules: dict = {}
        self.pipeline_stats = {"created": 0, "create_s": 0.0, "cache_loaded_bytes": 0, "cache_hits": 0,
                               "cache_misses": 0}
        self._cache_dirty = False
        self.cache_path = self._cache_path()
        self.cache = self._load_pipeline_cache()
        self.dummy = self.alloc(256)

    def describe(self) -> str:
        return describe(self.v, self.pd)

    # ---- memory ----------------------------------------------------------------------------------
    def _memory_type(self, bits: int, want: int) -> int | None:
        mp = self.mem_props
        for i in range(mp.memoryTypeCount):
            if bits & (1 << i) and (mp.memoryTypes[i].propertyFlags & want) == want:
                return i
        return None

    def _heap_and_block(self) -> tuple[int, int]:
        """(device-local heap bytes, pooled block bytes): blocks of 256 MiB, less where the
        driver's maxMemoryAllocationSize or a small heap says so ($SDRT_VULKAN_BLOCK_MB overrides)."""
        v, mp = self.v, self.mem_props
        heaps = [mp.memoryHeaps[i].size for i in range(mp.memoryHeapCount)
                 if mp.memoryHeaps[i].flags & v.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT] or \
                [mp.memoryHeaps[i].size for i in range(mp.memoryHeapCount)]
        heap = int(max(heaps))
        m3 = v.VkPhysicalDeviceMaintenance3Properties()
        v.vkGetPhysicalDeviceProperties2(self.pd, v.VkPhysicalDeviceProperties2(pNext=m3))
        cap = int(m3.maxMemoryAllocationSize) or heap
        want = int(float(os.environ.get("SDRT_VULKAN_BLOCK_MB", "256")) * 2**20)
        block = max(2**20, min(want, cap, heap // 8))
        return heap, block // self.alloc_align * self.alloc_align

    def _make(self, nbytes: int, host: bool, pooled: bool = False) -> _Buffer:
        v = self.v
        usage = (v.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | v.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                 | v.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        nbytes = max(16, (nbytes + 15) // 16 * 16)
        buf = v.vkCreateBuffer(self.device, v.VkBufferCreateInfo(size=nbytes, usage=usage,
                                                                  sharingMode=v.VK_SHARING_MODE_EXCLUSIVE), None)
        req = v.vkGetBufferMemoryRequirements(self.device, buf)
        if host:
            want = v.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | v.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
            t = self._memory_type(req.memoryTypeBits, want)
        else:
            t = self._memory_type(req.memoryTypeBits, v.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT)
            if t is None:
                t = self._memory_type(req.memoryTypeBits, 0)
        try:
            mem = v.vkAllocateMemory(self.device, v.VkMemoryAllocateInfo(allocationSize=req.size, memoryTypeIndex=t), None)
        except (v.VkErrorOutOfDeviceMemory, v.VkErrorOutOfHostMemory) as e:
            v.vkDestroyBuffer(self.device, buf, None)
            raise DeviceOutOfMemoryError(f"{self.name}: cannot allocate {nbytes / 2**20:.1f} MiB ({type(e).__name__})") from e
        v.vkBindBufferMemory(self.device, buf, mem, 0)
        mapped = None
        if host:
            mapped = np.frombuffer(v.vkMapMemory(self.device, mem, 0, nbytes, 0), dtype=np.uint8)
        return _Buffer(buf, mem, nbytes, mapped, pooled)

    def _new_slot(self, b: _Buffer) -> int:
        slot, self._next = self._next, self._next + 1
        self._slots[slot] = b
        self._held += b.size
        return slot

    def _destroy(self, slot: int) -> None:
        b = self._slots.pop(slot)
        self._held -= b.size
        if b.mapped is not None:
            self.v.vkUnmapMemory(self.device, b.memory)
        self.v.vkDestroyBuffer(self.device, b.buffer, None)
        self.v.vkFreeMemory(self.device, b.memory, None)

    def alloc(self, nbytes: int, host: bool = False) -> int:
        """Device memory for nbytes: its address. Device-local requests up to half a block are
        carved from pooled blocks of `block_bytes` (one VkDeviceMemory and one VkBuffer each);
        larger ones and host-visible (`host`, mapped) buffers get their own allocation."""
        n = max(self.alloc_align, -(-nbytes // self.alloc_align) * self.alloc_align)
        with self._lock:
            if host or n > self.block_bytes // 2:
                return self._new_slot(self._make(n, host)) << SLOT_SHIFT
            for slot in self._pool:
                off = self._slots[slot].take(n)
                if off is not None:
                    ptr = (slot << SLOT_SHIFT) + off
                    self._live[ptr] = n
                    return ptr
            try:
                block = self._make(self.block_bytes, False, pooled=True)
            except DeviceOutOfMemoryError:       # no room for a whole block: this request alone
                return self._new_slot(self._make(n, False)) << SLOT_SHIFT
            slot = self._new_slot(block)
            self._pool.append(slot)
            ptr = (slot << SLOT_SHIFT) + block.take(n)
            self._live[ptr] = n
            return ptr

    def free(self, ptr: int, _shift=SLOT_SHIFT, _mask=OFFSET_MASK) -> None:
        # the constants are bound as defaults: weakref callbacks call this at interpreter exit too
        with self._lock:
            slot = ptr >> _shift
            b = self._slots.get(slot)
            if b is None:
                return
            if not b.pooled:
                self._destroy(slot)
                return
            n = self._live.pop(ptr, None)
            if n is None:
                return
            b.give(ptr & _mask, n)
            # keep one wholly free block for the next allocation; give further ones back
            empty = [s for s in self._pool if self._slots[s].used == 0]
            for s in empty[1:]:
                self._pool.remove(s)
                self._destroy(s)

    def resolve(self, ptr: int) -> tuple[_Buffer, int]:
        return self._slots[ptr >> SLOT_SHIFT], ptr & OFFSET_MASK

    def mapped(self, ptr: int, nbytes: int) -> np.ndarray:
        b, off = self.resolve(ptr)
        return b.mapped[off:off + nbytes]

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total): the device-local heap less what this device holds from the driver."""
        return max(0, self.heap_bytes - self._held), self.heap_bytes

    def _staging(self, nbytes: int) -> int:
        """A host-visible buffer of at least nbytes, kept for the next upload/download."""
        if self._stage_ptr and self._stage_size >= nbytes:
            return self._stage_ptr
        if self._stage_ptr:
            self.free(self._stage_ptr)
            self._stage_ptr = 0
        size = max(nbytes, 4 * 2**20)
        self._stage_ptr, self._stage_size = self.alloc(size, host=True), size
        return self._stage_ptr

    def upload(self, ptr: int, host_u8, stream: str = "compute"):
        host_u8 = np.ascontiguousarray(host_u8).view(np.uint8).reshape(-1)
        with self._lock:
            stage = self._staging(host_u8.nbytes)
            self.mapped(stage, host_u8.nbytes)[:] = host_u8
            self.one_shot(lambda cmd: self.cmd_copy(cmd, stage, ptr, host_u8.nbytes))

    def download(self, host_u8, ptr: int, stream: str = "compute") -> None:
        out = host_u8.view(np.uint8).reshape(-1)
        with self._lock:
            stage = self._staging(out.nbytes)
            self.one_shot(lambda cmd: self.cmd_copy(cmd, ptr, stage, out.nbytes))
            out[:] = self.mapped(stage, out.nbytes)

    def record(self, stream: str = "compute"):
        return None      # every submit here completes before it returns

    def wait(self, event, stream: str = "compute") -> None:
        pass

    def synchronize(self) -> None:
        self.v.vkQueueWaitIdle(self.queue)

    def stats(self) -> dict:
        """in_use: device-local bytes handed out (pooled allocations and dedicated buffers; the
        free runs inside partly used blocks are not counted, as a caching allocator's slack is
        not); cached: wholly free pooled blocks (what empty_cache gives back)."""
        with self._lock:
            cached = sum(self._slots[s].size for s in self._pool if self._slots[s].used == 0)
            dedicated = sum(b.size for b in self._slots.values() if not b.pooled and b.mapped is None)
            return {"in_use": sum(self._live.values()) + dedicated, "cached": cached, "held": self._held,
                    "blocks": len(self._pool), "buffers": len(self._slots), "block_bytes": self.block_bytes}

    def empty_cache(self) -> None:
        """Give wholly free pooled blocks back to the driver."""
        with self._lock:
            for s in [s for s in self._pool if self._slots[s].used == 0]:
                self._pool.remove(s)
                self._destroy(s)

    # ---- commands ----------------------------------------------------------------------------
    def cmd_copy(self, cmd, src: int, dst: int, nbytes: int) -> None:
        (sb, so), (db, do) = self.resolve(src), self.resolve(dst)
        self.v.vkCmdCopyBuffer(cmd, sb.buffer, db.buffer, 1, [self.v.VkBufferCopy(srcOffset=so, dstOffset=do, size=nbytes)])

    def barrier(self, cmd) -> None:
        v = self.v
        mb = v.VkMemoryBarrier(srcAccessMask=v.VK_ACCESS_SHADER_WRITE_BIT | v.VK_ACCESS_TRANSFER_WRITE_BIT,
                               dstAccessMask=v.VK_ACCESS_SHADER_READ_BIT | v.VK_ACCESS_SHADER_WRITE_BIT
                               | v.VK_ACCESS_TRANSFER_READ_BIT | v.VK_ACCESS_TRANSFER_WRITE_BIT)
        stages = v.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | v.VK_PIPELINE_STAGE_TRANSFER_BIT
        v.vkCmdPipelineBarrier(cmd, stages, stages, 0, 1, [mb], 0, None, 0, None)

    def new_command_buffer(self):
        v = self.v
        return v.vkAllocateCommandBuffers(self.device, v.VkCommandBufferAllocateInfo(
            commandPool=self.pool, level=v.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]

    def free_command_buffer(self, cmd) -> None:
        self.v.vkFreeCommandBuffers(self.device, self.pool, 1, [cmd])

    def begin(self, cmd, once: bool) -> None:
        v = self.v
        flags = v.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT if once else 0
        v.vkBeginCommandBuffer(cmd, v.VkCommandBufferBeginInfo(flags=flags))

    def submit(self, cmd) -> None:
        """Run a recorded command buffer and wait for it."""
        v = self.v
        with self._lock:
            v.vkQueueSubmit(self.queue, 1, [v.VkSubmitInfo(commandBufferCount=1, pCommandBuffers=[cmd])], self.fence)
            v.vkWaitForFences(self.device, 1, [self.fence], v.VK_TRUE, 2**63 - 1)
            v.vkResetFences(self.device, 1, [self.fence])

    def one_shot(self, fill) -> None:
        cmd = self.new_command_buffer()
        try:
            self.begin(cmd, once=True)
            fill(cmd)
            self.v.vkEndCommandBuffer(cmd)
            self.submit(cmd)
        finally:
            self.free_command_buffer(cmd)

    # ---- pipelines ---------------------------------------------------------------------------
    def _layouts(self) -> None:
        v = self.v
        binds = [v.VkDescriptorSetLayoutBinding(binding=i, descriptorType=v.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                descriptorCount=1, stageFlags=v.VK_SHADER_STAGE_COMPUTE_BIT)
                 for i in range(BINDINGS)]
        self.set_layout = v.vkCreateDescriptorSetLayout(self.device, v.VkDescriptorSetLayoutCreateInfo(
            bindingCount=BINDINGS, pBindings=binds), None)
        push = v.VkPushConstantRange(stageFlags=v.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=PUSH_BYTES)
        self.pipeline_layout = v.vkCreatePipelineLayout(self.device, v.VkPipelineLayoutCreateInfo(
            setLayoutCount=1, pSetLayouts=[self.set_layout], pushConstantRangeCount=1,
            pPushConstantRanges=[push]), None)

    def pipeline(self, shader: str, spec: tuple[int, ...]):
        """The compute pipeline of shaders/<shader>.spv with specialization constants 0.. = spec
        (made once per (shader, spec) and kept)."""
        key = (shader, spec)
        p = self._pipelines.get(key)
        if p is not None:
            return p
        v = self.v
        mod = self._modules.get(shader)
        if mod is None:
            from .shaders import spirv
            code = spirv(shader)
            mod = self._modules[shader] = v.vkCreateShaderModule(self.device, v.VkShaderModuleCreateInfo(
                codeSize=len(code), pCode=code), None)
        data = np.asarray(spec, dtype=np.int32).tobytes()
        entries = [v.VkSpecializationMapEntry(constantID=i, offset=4 * i, size=4) for i in range(len(spec))]
        si = v.VkSpecializationInfo(mapEntryCount=len(spec), pMapEntries=entries, dataSize=len(data),
                                    pData=v.ffi.from_buffer(data)) if spec else None
        stage = v.VkPipelineShaderStageCreateInfo(stage=v.VK_SHADER_STAGE_COMPUTE_BIT, module=mod, pName="main",
                                                  pSpecializationInfo=si)
        fb = fbi = None
        if self.feedback:
            fb = v.ffi.new("VkPipelineCreationFeedback *")
            fbi = v.VkPipelineCreationFeedbackCreateInfo(pPipelineCreationFeedback=fb,
                                                         pipelineStageCreationFeedbackCount=0)
        t0 = time.perf_counter()
        p = v.vkCreateComputePipelines(self.device, self.cache, 1, [v.VkComputePipelineCreateInfo(
            pNext=fbi, stage=stage, layout=self.pipeline_layout)], None)[0]
        if fb is not None and fb.flags & v.VK_PIPELINE_CREATION_FEEDBACK_VALID_BIT:
            hit = bool(fb.flags & v.VK_PIPELINE_CREATION_FEEDBACK_APPLICATION_PIPELINE_CACHE_HIT_BIT)
            self.pipeline_stats["cache_hits" if hit else "cache_misses"] += 1
        self.pipeline_stats["created"] += 1
        self.pipeline_stats["create_s"] += time.perf_counter() - t0
        self._cache_dirty = True
        self._pipelines[key] = p
        return p

    # ---- the disk pipeline cache -----------------------------------------------------------------
    def _cache_path(self) -> str | None:
        """$SDRT_VULKAN_CACHE (a directory; "0" turns the cache off) or <user cache dir>/sdrt/vulkan
        ($XDG_CACHE_HOME, else ~/.cache): one file per device and driver, named by the device's
        and the driver's UUIDs and the driver's pipelineCacheUUID (a driver update starts afresh)."""
        v = self.v
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        where = os.environ.get("SDRT_VULKAN_CACHE", os.path.join(base, "sdrt", "vulkan"))
        if where == "0":
            return None
        ids = v.VkPhysicalDeviceIDProperties()
        v.vkGetPhysicalDeviceProperties2(self.pd, v.VkPhysicalDeviceProperties2(pNext=ids))
        device_uuid = bytes(bytearray(ids.deviceUUID)).hex()
        driver_uuid = bytes(bytearray(ids.driverUUID)).hex()
        cache_uuid = bytes(bytearray(self.props.pipelineCacheUUID)).hex()
        return os.path.join(where, f"{device_uuid}-{driver_uuid}-{cache_uuid}.bin")

    def _load_pipeline_cache(self):
        """A VkPipelineCache seeded from the disk file when there is one (the driver ignores data
        that is not its own), so a second process does not recompile its pipelines."""
        v = self.v
        data = b""
        if self.cache_path is not None and os.path.exists(self.cache_path):
            try:
                with open(self.cache_path, "rb") as f:
                    data = f.read()
            except OSError as e:
                log.debug("%s: pipeline cache %s unreadable: %s", self.name, self.cache_path, e)
        self.pipeline_stats["cache_loaded_bytes"] = len(data)
        info = v.VkPipelineCacheCreateInfo(initialDataSize=len(data), pInitialData=v.ffi.from_buffer(data)) \
            if data else v.VkPipelineCacheCreateInfo()
        return v.vkCreatePipelineCache(self.device, info, None)

    def save_pipeline_cache(self) -> int:
        """Write the pipeline cache to disk if pipelines were made since the last save (bytes written)."""
        if self.cache_path is None or not self._cache_dirty:
            return 0
        from vulkan import _vulkan
        ffi, lib = _vulkan.ffi, _vulkan.lib
        try:
            size = ffi.new("size_t *")
            lib.vkGetPipelineCacheData(self.device, self.cache, size, ffi.NULL)
            buf = ffi.new("char[]", size[0])
            lib.vkGetPipelineCacheData(self.device, self.cache, size, buf)
            os.makedirs(os.path.dirname(self.cache_path), exist_ok=True)
            tmp = f"{self.cache_path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(ffi.buffer(buf, size[0]))
            os.replace(tmp, self.cache_path)
        except Exception as e:  # a cache is an optimization: never fail a run over it
            log.debug("%s: pipeline cache not saved: %s", self.name, e)
            return 0
        self._cache_dirty = False
        return int(size[0])

    def descriptor_pool(self, sets: int):
        v = self.v
        size = v.VkDescriptorPoolSize(type=v.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=max(1, sets) * BINDINGS)
        return v.vkCreateDescriptorPool(self.device, v.VkDescriptorPoolCreateInfo(
            maxSets=max(1, sets), poolSizeCount=1, pPoolSizes=[size]), None)

    def destroy_descriptor_pool(self, pool) -> None:
        self.v.vkDestroyDescriptorPool(self.device, pool, None)

    def descriptor_set(self, pool, ranges):
        """A descriptor set binding (buffer, offset, range) at bindings 0..BINDINGS-1."""
        v = self.v
        ds = v.vkAllocateDescriptorSets(self.device, v.VkDescriptorSetAllocateInfo(
            descriptorPool=pool, descriptorSetCount=1, pSetLayouts=[self.set_layout]))[0]
        writes = [v.VkWriteDescriptorSet(dstSet=ds, dstBinding=i, descriptorCount=1,
                                         descriptorType=v.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                         pBufferInfo=[v.VkDescriptorBufferInfo(buffer=b, offset=o, range=r)])
                  for i, (b, o, r) in enumerate(ranges)]
        v.vkUpdateDescriptorSets(self.device, len(writes), writes, 0, None)
        return ds

    def dispatch(self, cmd, pipeline, ds, push: bytes, groups) -> None:
        v = self.v
        v.vkCmdBindPipeline(cmd, v.VK_PIPELINE_BIND_POINT_COMPUTE, pipeline)
        v.vkCmdBindDescriptorSets(cmd, v.VK_PIPELINE_BIND_POINT_COMPUTE, self.pipeline_layout, 0, 1, [ds], 0, None)
        push = push.ljust(PUSH_BYTES, b"\0")
        v.vkCmdPushConstants(cmd, self.pipeline_layout, v.VK_SHADER_STAGE_COMPUTE_BIT, 0, PUSH_BYTES,
                             v.ffi.from_buffer(push))
        v.vkCmdDispatch(cmd, *groups)
